//! `meshfs ui`: asks the running daemon to serve its page (control op `ui`), reads the page's
//! token from the state directory (readable by this user only) and opens the page in the
//! browser, or prints its address (`--print-url`). The token never goes on a command line:
//! the browser is given a file in the state directory that forwards to the address, as
//! Jupyter does, since another user can read a process's arguments.

use crate::{reply_error, reply_ok, EXIT_NO_DAEMON};
use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, ConfigError, Home};
use meshfs_daemon::control::{self, Request};
use meshfs_daemon::ui::write_private;
use std::process::{Command, Stdio};

/// Runs `meshfs ui`; returns the exit code.
pub fn run(home: &Home, print_url: bool) -> anyhow::Result<u8> {
    if let Err(e @ ConfigError::Missing(_)) = Config::load(home) {
        return Err(e.into());
    }
    let reply = match control::request(home, &Request::Ui)? {
        None => {
            eprintln!(
                "meshfs: the daemon is not running; the page is served by it (`meshfs daemon`)"
            );
            return Ok(EXIT_NO_DAEMON);
        }
        Some(r) if reply_ok(&r) => r,
        Some(r) => bail!("{}", reply_error(&r, "the daemon cannot serve the page")),
    };
    let address = reply["url"]
        .as_str()
        .ok_or_else(|| anyhow!("the daemon's answer has no address: {reply}"))?;
    let file = home.ui_token_file();
    let token = std::fs::read_to_string(&file)
        .map_err(|e| anyhow!("cannot read the page's token {}: {e}", file.display()))?;
    let url = format!("{address}?token={}", token.trim());
    if print_url {
        println!("{url}");
        return Ok(0);
    }
    let opener = home.state_dir.join("ui-open.html");
    write_private(
        &opener,
        &format!(
            "<!doctype html><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"0; url={url}\"><title>meshfs</title><a href=\"{url}\">Open the meshfs page</a>\n"
        ),
    )
    .map_err(|e| anyhow!("cannot write {}: {e}", opener.display()))?;
    let opened = Command::new("xdg-open")
        .arg(&opener)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    match opened {
        Ok(_) => println!("opening the page in the browser ({address})"),
        Err(e) => {
            eprintln!("meshfs: cannot start a browser (xdg-open: {e}); open this address:");
            println!("{url}");
        }
    }
    Ok(0)
}
