#!/usr/bin/env bash
# Installs meshfs from this source tree on a fresh Debian (12 or later) machine: build tools,
# Rust (rustup, if cargo is missing), cargo-deb, then builds the .deb and installs it with apt.
# Run as a user with sudo. Afterwards:
#   meshfs init --name "$(hostname)" && systemctl --user enable --now meshfs
set -euo pipefail
cd "$(dirname "$0")/.."
sudo apt-get update
sudo apt-get install -y build-essential pkg-config curl fuse3
if ! command -v cargo >/dev/null; then
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb
packaging/build-deb
deb=$(ls -t target/debian/meshfs_*.deb | head -n1)
sudo apt-get install -y "./$deb"
meshfs --version
echo "installed $deb; next: meshfs init, then systemctl --user enable --now meshfs (or, for a"
echo "server, sudo systemctl enable --now meshfs@USER)"
