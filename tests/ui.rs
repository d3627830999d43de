//! The page (`meshfs ui`): what a person sees in a real browser against two real daemons, and
//! who gets in (docs/ui.md): nobody without the token, no other `Host`, no change from another
//! origin, no other local user.

use crate::common;
use common::browser::{self, Browser};
use common::*;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The page's address with its token, as `meshfs ui --print-url` prints it.
fn page_url(d: &Device) -> String {
    ok(&d.home, &["ui", "--print-url"]).trim().to_string()
}

/// The port and the token in a page address.
fn port_and_token(url: &str) -> (u16, String) {
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("a loopback address");
    let (port, query) = rest.split_once("/?token=").expect("a token");
    (port.parse().unwrap(), query.to_string())
}

/// One answer as read off the wire.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// Sends `request` (a whole HTTP/1.1 request) to the page on `addr` and reads the answer.
fn http(addr: &str, request: &str) -> Answer {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Answer {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// What the page shows, for a failure's message.
const SHOW: &str = "return document.body.innerText.slice(0, 4000)";

#[test]
fn a_sync_a_conflict_and_a_journal_filter_show_live_on_the_page_in_a_real_browser() {
    let Some((chromium, driver)) = browser::chromium() else {
        return;
    };
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("before.txt"), b"already here");
    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 30);
    let short_a = a.status()["device"]["short_id"]
        .as_str()
        .unwrap()
        .to_string();
    let short_b = b.status()["device"]["short_id"]
        .as_str()
        .unwrap()
        .to_string();
    let web = Browser::start(&chromium, &driver, 1100, 1000);
    // `meshfs ui` as a person runs it, with an `xdg-open` that notes what it was given: a
    // file, not the address with its token (which every user could read in its arguments).
    let bin_dir = t.path().join("fake-bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let opened = t.path().join("opened");
    let xdg_open = bin_dir.join("xdg-open");
    std::fs::write(
        &xdg_open,
        // Written aside and renamed: the test sees the whole line or nothing.
        format!(
            "#!/bin/sh\necho \"$@\" > {o}.tmp && mv {o}.tmp {o}\n",
            o = opened.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&xdg_open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(bin())
        .arg("--home")
        .arg(&b.home)
        .arg("ui")
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !opened.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let file = std::fs::read_to_string(&opened).unwrap().trim().to_string();
    assert!(!file.contains("token"), "{file}");
    assert_eq!(Path::new(&file), b.home.join("state/ui-open.html"));
    web.go(&format!("file://{file}"));
    web.wait_for(
        "the folder in sync and the stream live",
        20,
        r#"return document.querySelector('#live').textContent === 'live'
            && document.querySelector('[data-folder="work"]').dataset.inSync === 'true'
            && !!document.querySelector('#rows tr[data-path="before.txt"]')"#,
        SHOW,
    );
    assert_eq!(
        web.js("return location.search"),
        "",
        "the token left the address"
    );
    // Anything the page shows from now on comes over its stream, not from a reload.
    web.js("window.notReloaded = true; return null");
    web.screenshot("1-in-sync.png");

    write(&a.path("report.txt"), b"first draft");
    web.wait_for(
        "report.txt written on a, journaled and in sync on b",
        30,
        r#"return window.notReloaded === true
            && !!document.querySelector('#rows tr[data-path="report.txt"][data-op="create"]')
            && document.querySelector('[data-folder="work"]').dataset.inSync === 'true'
            && document.querySelector('#head [data-in-sync]').dataset.inSync === 'true'"#,
        SHOW,
    );
    assert_eq!(std::fs::read(b.path("report.txt")).unwrap(), b"first draft");
    let peer = web.js(&format!(
        "return document.querySelector('[data-peer=\"{short_a}\"]').innerText"
    ));
    let peer = peer.as_str().unwrap();
    assert!(
        peer.contains("connected, rtt") && peer.contains(&a.addr),
        "{peer}"
    );
    web.screenshot("2-synced-from-a.png");

    // The same file edited on both devices while a is down: a conflict once a is back.
    a.stop();
    write(&a.path("report.txt"), b"edited on a");
    std::thread::sleep(Duration::from_millis(50));
    write(&b.path("report.txt"), b"edited on b, later");
    a.start();
    let conflict = r#"document.querySelector('#conflicts li[data-original="report.txt"]')"#;
    web.wait_for(
        "the conflict",
        30,
        &format!("return window.notReloaded === true && !!{conflict}"),
        SHOW,
    );
    let text = web.js(&format!("return {conflict}.innerText"));
    let text = text.as_str().unwrap();
    assert!(
        text.contains(&format!(
            "kept as report.txt: by b (this device) ({short_b})"
        )) && text.contains("other version as report.sync-conflict-")
            && text.contains(&format!("by a ({short_a}), 11 bytes")),
        "{text}"
    );
    web.screenshot("3-conflict.png");

    web.type_into("#filter input[name=path]", "report.txt");
    web.type_into("#filter input[name=device]", "a");
    web.click("#filter button");
    let rows = "[...document.querySelectorAll('#rows tr[data-path]')]";
    web.wait_for(
        "only a's changes of report.txt",
        20,
        &format!(
            "const rows = {rows}; return window.notReloaded === true && rows.length > 0
                && rows.every(r => r.dataset.path === 'report.txt'
                    && r.children[2].textContent === '{short_a}')"
        ),
        SHOW,
    );
    let shown: Vec<u64> = web
        .js(&format!("return {rows}.map(r => Number(r.dataset.seq))"))
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let mut cli: Vec<u64> = b
        .journal(&["--path", "report.txt", "--device", "a"])
        .iter()
        .map(|e| e["sequence"].as_u64().unwrap())
        .collect();
    cli.reverse();
    assert_eq!(shown, cli, "the rows of `meshfs journal`, newest first");
    let search = web.js("return location.search");
    assert!(
        search.as_str().unwrap().contains("path=report.txt"),
        "{search}"
    );
    web.screenshot("4-journal-filtered.png");

    // The page's own button gets through the same-origin check of a real browser.
    web.click("[data-folder=\"work\"] form button");
    web.wait_for(
        "the rescan's outcome",
        20,
        "return !!document.querySelector('.notice') && document.querySelector('.notice')
            .textContent.startsWith('rescan of folder work: ')",
        SHOW,
    );

    web.resize(390, 844);
    web.wait_for(
        "a phone-sized window without sideways scrolling",
        10,
        "return window.innerWidth <= 400
            && document.documentElement.scrollWidth <= window.innerWidth",
        "return [window.innerWidth, document.documentElement.scrollWidth]",
    );
    web.screenshot("5-phone.png");
}

#[test]
fn without_the_token_every_address_answers_401_and_tells_nothing_and_another_host_is_refused() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    // Served from the start: enabled in the config, no `meshfs ui` needed.
    let config = a.home.join("config.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[ui]\nenabled = true\n");
    std::fs::write(&config, text).unwrap();
    write(&a.path("secret-name.txt"), b"x");
    a.start();
    let token_file = a.home.join("state/ui-token");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&token_file), 0o600);
    assert_eq!(mode(&a.home.join("state")), 0o700);
    let before = std::fs::read_to_string(&token_file).unwrap();
    let url = page_url(&a);
    let (port, token) = port_and_token(&url);
    assert_eq!(before.trim(), token, "`meshfs ui` found the page served");
    let addr = format!("127.0.0.1:{port}");
    let host = format!("Host: 127.0.0.1:{port}");
    let cookie = format!("Cookie: meshfs-ui-{port}={token}");
    let device_id = a.id.clone();
    let short = a.status()["device"]["short_id"]
        .as_str()
        .unwrap()
        .to_string();

    let wrong = "0".repeat(64);
    for (method, target) in [
        ("GET", "/".to_string()),
        ("HEAD", "/".to_string()),
        ("GET", "/?folder=work&path=secret-name.txt".to_string()),
        ("GET", "/events".to_string()),
        ("GET", "/app.js".to_string()),
        ("GET", "/app.css".to_string()),
        ("POST", "/scan?folder=work".to_string()),
        ("GET", "/no-such-page".to_string()),
        ("GET", format!("/?token={wrong}")),
        ("POST", format!("/scan?folder=work&token={token}")),
    ] {
        let r = http(
            &addr,
            &format!(
                "{method} {target} HTTP/1.1\r\n{host}\r\nOrigin: http://127.0.0.1:{port}\r\n\r\n"
            ),
        );
        assert_eq!(r.status, 401, "{method} {target}: {}", r.head);
        for secret in ["work", "secret-name", &device_id, &short, &token] {
            assert!(
                !r.body.contains(secret) && !r.head.contains(secret),
                "{method} {target} tells {secret}: {}{}",
                r.head,
                r.body
            );
        }
        assert!(!r.head.contains("Set-Cookie"));
    }

    // Another name for this address (DNS rebinding), or none: refused even with the cookie.
    for h in [
        format!("Host: evil.example:{port}"),
        format!("Host: 127.0.0.1:{}", port.wrapping_add(1)),
        String::new(),
    ] {
        let r = http(&addr, &format!("GET / HTTP/1.1\r\n{h}\r\n{cookie}\r\n\r\n"));
        assert_eq!(r.status, 403, "{h}: {}", r.head);
        assert!(!r.body.contains("secret-name"));
    }
    // A change asked by another origin (or by none) is refused; the page's own goes through.
    let scan = |origin: &str| {
        http(
            &addr,
            &format!("POST /scan?folder=work HTTP/1.1\r\n{host}\r\n{cookie}\r\n{origin}Content-Length: 0\r\n\r\n"),
        )
    };
    assert_eq!(scan("Origin: http://evil.example\r\n").status, 403);
    assert_eq!(scan("").status, 403);
    assert_eq!(
        scan(&format!(
            "Origin: http://127.0.0.1:{port}\r\nSec-Fetch-Site: cross-site\r\n"
        ))
        .status,
        403
    );
    let done = scan(&format!(
        "Origin: http://127.0.0.1:{port}\r\nSec-Fetch-Site: same-origin\r\n"
    ));
    assert_eq!(done.status, 303, "{}", done.head);
    assert!(done.head.contains("Location: /?folder=work&scanned="));

    // The token logs in: an HttpOnly, SameSite=Strict cookie, and on to the address without it.
    let login = http(
        &addr,
        &format!("GET /?token={token} HTTP/1.1\r\n{host}\r\n\r\n"),
    );
    assert_eq!(login.status, 200);
    assert!(
        login.head.contains(&format!(
            "Set-Cookie: meshfs-ui-{port}={token}; Path=/; HttpOnly; SameSite=Strict"
        )),
        "{}",
        login.head
    );
    assert!(login.body.contains("url=/\""), "{}", login.body);
    // With the cookie the page reads without JavaScript, its filter too.
    let page = http(
        &addr,
        &format!("GET / HTTP/1.1\r\n{host}\r\n{cookie}\r\n\r\n"),
    );
    assert_eq!(page.status, 200);
    assert!(page.body.contains("data-path=\"secret-name.txt\""));
    let filtered = http(
        &addr,
        &format!("GET /?folder=work&path=other.txt HTTP/1.1\r\n{host}\r\n{cookie}\r\n\r\n"),
    );
    assert!(filtered.body.contains("0 entries of folder work"));
    assert!(!filtered.body.contains("data-path=\"secret-name.txt\""));

    // Loopback's other addresses are not served: only 127.0.0.1 is bound.
    assert!(std::net::TcpStream::connect(format!("127.0.0.2:{port}")).is_err());

    // A bounded request: a head of megabytes is cut off with 431, not read to its end.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    let _ = s.write_all(format!("GET / HTTP/1.1\r\nX: {}", "y".repeat(64 << 10)).as_bytes());
    let mut answer = String::new();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:.200}");

    a.stop();
    assert!(!token_file.exists(), "the token goes with the daemon");
}

#[test]
fn a_kept_version_and_a_deleted_file_are_restored_from_their_journal_rows_on_the_page_and_never_by_a_request_from_elsewhere(
) {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("report.txt"), b"first draft");
    write(&a.path("plan.txt"), b"the plan, deleted by mistake");
    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 30);
    write(&a.path("report.txt"), b"second draft, a mistake");
    std::fs::remove_file(a.path("plan.txt")).unwrap();
    wait_synced(&[&a, &b], 30);
    // B applied A's edit and kept what it replaced: the creation's row is `kept` on B.
    let kept = |b: &Device| {
        b.journal(&["--path", "report.txt"])
            .into_iter()
            .find(|r| r["op"] == "create" && r["content"] == "kept")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while kept(&b).is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "B never kept the first draft"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let seq = kept(&b).unwrap()["sequence"].as_u64().unwrap();
    let current = b.journal(&["--path", "report.txt"]).last().unwrap()["sequence"]
        .as_u64()
        .unwrap();
    // On A, where it was deleted, the deleted file's creation can come back (kept here, or
    // asked of B); the deletion's own row cannot.
    let plan = a.journal(&["--path", "plan.txt"]);
    let created = plan.iter().find(|r| r["op"] == "create").unwrap();
    let deleted = plan.iter().find(|r| r["op"] == "delete").unwrap();
    assert!(
        ["kept", "partial", "not_here"].contains(&created["content"].as_str().unwrap()),
        "{plan:?}"
    );
    let plan_seq = created["sequence"].as_u64().unwrap();
    let plan_deleted = deleted["sequence"].as_u64().unwrap();

    let guard = |d: &Device| {
        let (port, token) = port_and_token(&page_url(d));
        (
            format!("127.0.0.1:{port}"),
            format!("Host: 127.0.0.1:{port}"),
            format!("Cookie: meshfs-ui-{port}={token}\r\n"),
            format!("Origin: http://127.0.0.1:{port}\r\nSec-Fetch-Site: same-origin\r\n"),
            port,
        )
    };
    let (addr, host, cookie, ours, port) = guard(&b);
    let restore = |sequence: u64, host: &str, cookie: &str, origin: &str| {
        http(
            &addr,
            &format!(
                "POST /restore?folder=work&sequence={sequence} HTTP/1.1\r\n{host}\r\n{cookie}{origin}Content-Length: 0\r\n\r\n"
            ),
        )
    };
    // Without the cookie, to another host name, from another site, from no page at all, or
    // said to be cross-site by the browser: refused, and nothing is restored.
    assert_eq!(restore(seq, &host, "", &ours).status, 401);
    let rebound = format!("Host: meshfs.evil.example:{port}");
    assert_eq!(restore(seq, &rebound, &cookie, &ours).status, 403);
    assert_eq!(
        restore(seq, &host, &cookie, "Origin: http://evil.example\r\n").status,
        403
    );
    assert_eq!(restore(seq, &host, &cookie, "").status, 403);
    let cross = format!("Origin: http://127.0.0.1:{port}\r\nSec-Fetch-Site: cross-site\r\n");
    assert_eq!(restore(seq, &host, &cookie, &cross).status, 403);
    let get = http(
        &addr,
        &format!("GET /restore?folder=work&sequence={seq} HTTP/1.1\r\n{host}\r\n{cookie}\r\n"),
    );
    assert_eq!(get.status, 405, "a restore is never a GET");
    // The same for the deleted file, on A's page.
    let (a_addr, a_host, a_cookie, a_ours, a_port) = guard(&a);
    let restore_on_a = |sequence: u64, host: &str, cookie: &str, origin: &str| {
        http(
            &a_addr,
            &format!(
                "POST /restore?folder=work&sequence={sequence} HTTP/1.1\r\n{host}\r\n{cookie}{origin}Content-Length: 0\r\n\r\n"
            ),
        )
    };
    assert_eq!(restore_on_a(plan_seq, &a_host, "", &a_ours).status, 401);
    let a_rebound = format!("Host: meshfs.evil.example:{a_port}");
    assert_eq!(
        restore_on_a(plan_seq, &a_rebound, &a_cookie, &a_ours).status,
        403
    );
    assert_eq!(
        restore_on_a(
            plan_seq,
            &a_host,
            &a_cookie,
            "Origin: http://evil.example\r\n"
        )
        .status,
        403
    );
    // What cannot be restored says why, and changes nothing.
    let now = restore(current, &host, &cookie, &ours);
    assert_eq!(now.status, 404, "{}", now.head);
    assert!(now.body.contains("nothing to restore"), "{}", now.body);
    let none = restore(999_999, &host, &cookie, &ours);
    assert_eq!(none.status, 404);
    assert!(none.body.contains("no row 999999"), "{}", none.body);
    let gone = restore_on_a(plan_deleted, &a_host, &a_cookie, &a_ours);
    assert_eq!(gone.status, 404, "{}", gone.head);
    assert!(gone.body.contains("names no past version"), "{}", gone.body);
    std::thread::sleep(Duration::from_millis(300));
    for d in [&a, &b] {
        assert_eq!(
            std::fs::read(d.path("report.txt")).unwrap(),
            b"second draft, a mistake"
        );
        assert!(
            !d.path("plan.txt").exists(),
            "restored by a refused request"
        );
    }

    // The page's own buttons, in a real browser where there is one (else the same requests).
    let row = format!("#rows tr[data-seq=\"{seq}\"][data-content=\"kept\"]");
    let plan_row = format!("#rows tr[data-seq=\"{plan_seq}\"]");
    match browser::chromium() {
        Some((chromium, driver)) => {
            let web = Browser::start(&chromium, &driver, 1100, 1000);
            web.go(&page_url(&b));
            web.wait_for(
                "the kept first draft with its restore button",
                20,
                &format!("return !!document.querySelector('{row} form button')"),
                SHOW,
            );
            web.screenshot("restore-1-kept.png");
            web.click(&format!("{row} form button"));
            web.wait_for(
                "the restore's outcome",
                30,
                &format!(
                    "const n = document.querySelector('.notice'); return !!n
                        && n.textContent === 'version {seq} of report.txt restored: a new change of this device, sent to its peers'"
                ),
                SHOW,
            );
            web.screenshot("restore-2-done.png");
            wait_synced(&[&a, &b], 30);
            // On A, where it was deleted: the creation's row has the button, the deletion's
            // row none. Its content is not kept on A: with B stopped, no one has it, and the
            // page says so; nothing is written.
            b.stop();
            web.go(&page_url(&a));
            web.wait_for(
                "B gone from A's page",
                20,
                "return !!document.querySelector('#peers') && !document.querySelector('#peers .badge.ok')",
                SHOW,
            );
            if created["content"] == "not_here" {
                web.click(&format!("{plan_row} form button"));
                web.wait_for(
                    "why the deleted file could not come back",
                    30,
                    "const n = document.querySelector('#not-restored');
                        return !!n && n.textContent.startsWith('not restored: plan.txt: ')
                            && n.textContent.endsWith('is kept neither here nor by a connected peer')",
                    SHOW,
                );
                web.screenshot("restore-3-unavailable.png");
                assert!(!a.path("plan.txt").exists());
            } else {
                eprintln!("note: A kept the deleted file's content; the no-peer case is not shown");
            }
            b.start();
            wait_synced(&[&a, &b], 30);
            web.go(&page_url(&a));
            web.wait_for(
                "the deleted file's row with its restore button, the deletion's without",
                20,
                &format!(
                    "return !!document.querySelector('#peers .badge.ok')
                        && !!document.querySelector('{plan_row} form button')
                        && !!document.querySelector('#rows tr[data-seq=\"{plan_deleted}\"]')
                        && !document.querySelector('#rows tr[data-seq=\"{plan_deleted}\"] form')"
                ),
                SHOW,
            );
            web.screenshot("restore-4-deleted.png");
            web.click(&format!("{plan_row} form button"));
            web.wait_for(
                "the deleted file back, and its row current with no button",
                30,
                &format!(
                    "const n = document.querySelector('.notice'); return !!n
                        && n.textContent === 'version {plan_seq} of plan.txt restored: a new change of this device, sent to its peers'
                        && !!document.querySelector('{plan_row}[data-content=\"current\"]')
                        && !document.querySelector('{plan_row} form')"
                ),
                SHOW,
            );
            web.screenshot("restore-5-deleted-back.png");
        }
        None => {
            let done = restore(seq, &host, &cookie, &ours);
            assert_eq!(done.status, 303, "{}", done.head);
            assert!(done.head.contains(&format!(
                "Location: /?folder=work&restored={seq}&restored_path=report.txt"
            )));
            let back = restore_on_a(plan_seq, &a_host, &a_cookie, &a_ours);
            assert_eq!(back.status, 303, "{}", back.head);
        }
    }
    wait_synced(&[&a, &b], 30);
    for d in [&a, &b] {
        assert_eq!(std::fs::read(d.path("report.txt")).unwrap(), b"first draft");
        assert_eq!(
            std::fs::read(d.path("plan.txt")).unwrap(),
            b"the plan, deleted by mistake"
        );
    }
    // Journaled as the restoring device's own new version, as `meshfs restore` does.
    let last = b.journal(&["--path", "report.txt"]).pop().unwrap();
    assert_eq!(last["modified_by"], b.status()["device"]["short_id"]);
    let last = b.journal(&["--path", "plan.txt"]).pop().unwrap();
    assert_eq!(last["modified_by"], a.status()["device"]["short_id"]);
}

#[test]
fn an_on_demand_folder_shows_its_budget_what_is_local_the_free_floor_and_a_file_being_fetched_for_its_process(
) {
    use std::io::{Seek, SeekFrom};
    let Some((chromium, driver)) = browser::chromium() else {
        return;
    };
    if not_root() {
        eprintln!("SKIPPED: the on-demand mount needs root");
        return;
    }
    const MIB: usize = 1 << 20;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    write(&a.path("big.bin"), &noise(16 * MIB, 49));
    write(&a.path("notes.txt"), b"read once, local since");
    ok(
        &b.home,
        &[
            "folder",
            "set",
            "work",
            "--on-demand",
            "--cache-max",
            "64MiB",
            // A floor of its own: the default (5 % of the disk) would evict what the test
            // fetches whenever the machine's disk is nearly full.
            "--min-free",
            "1MiB",
        ],
    );
    pair(&a, &b);
    Device::start_together(&mut [&mut a, &mut b]);
    let mnt = t.path().join("mnt-b");
    std::fs::create_dir_all(&mnt).unwrap();
    ok(&b.home, &["mount", "work", mnt.to_str().unwrap()]);
    for d in [&a, &b] {
        ok(
            &d.home,
            &["status", "--wait-synced", "--connected", "--timeout", "60"],
        );
    }
    assert_eq!(
        std::fs::read(mnt.join("notes.txt")).unwrap(),
        b"read once, local since"
    );
    // A reader holds big.bin open with 64 KiB of its middle read: it is being fetched, for
    // this thread (FUSE names the calling thread), until it is closed.
    let mut open = std::fs::File::open(mnt.join("big.bin")).unwrap();
    open.seek(SeekFrom::Start(8 * MIB as u64)).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    std::io::Read::read_exact(&mut open, &mut buf).unwrap();
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };

    let web = Browser::start(&chromium, &driver, 1100, 900);
    web.go(&page_url(&b));
    let fetching = format!(".ondemand .fetching li[data-path=\"big.bin\"][data-pid=\"{tid}\"]");
    web.wait_for(
        "the on-demand facts: local and online, the budget, the floor, the fetch and its process",
        20,
        &format!(
            r#"const od = document.querySelector('[data-folder="work"] .ondemand');
            const f = document.querySelector('{fetching}');
            return !!od && !!f
                && od.querySelector('.od-summary').textContent.startsWith('on demand: ')
                && od.querySelector('.od-summary').textContent.endsWith(' online only in 1 file (budget 64MiB)')
                && /^budget: .* of 64MiB used \(\d+%\)$/.test(od.querySelector('.od-budget').textContent.trim())
                && !!od.querySelector('.od-budget meter')
                && /^disk: .* free, kept above 1MiB \(1MiB\) by evicting$/.test(od.querySelector('.od-floor').textContent)
                && f.textContent.startsWith('fetching big.bin for pid {tid}: ')
                && f.textContent.includes(' of 16MiB')
                && !!f.querySelector('progress')"#
        ),
        SHOW,
    );
    web.screenshot("on-demand-1-fetching.png");
    // Closed: the fetch ends, and the live page drops it without a reload.
    drop(open);
    web.wait_for(
        "the fetch gone from the live page",
        20,
        &format!(
            "return document.querySelector('#live').textContent === 'live'
                && !!document.querySelector('.ondemand') && !document.querySelector('{fetching}')"
        ),
        SHOW,
    );
}

/// A local user made for one test, removed when it ends.
struct OtherUser {
    name: String,
    uid: String,
}

impl OtherUser {
    fn new() -> OtherUser {
        let name = format!("mfsui{}", std::process::id());
        let made = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                &name,
            ])
            .status()
            .expect("useradd");
        assert!(made.success(), "useradd {name}");
        let id = Command::new("id").args(["-u", &name]).output().unwrap();
        let uid = String::from_utf8_lossy(&id.stdout).trim().to_string();
        OtherUser { name, uid }
    }

    /// Runs `args` as this user (no supplementary groups, no capabilities).
    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("setpriv")
            .args([
                &format!("--reuid={}", self.uid),
                &format!("--regid={}", self.uid),
                "--clear-groups",
                "--",
            ])
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for OtherUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

#[test]
fn another_local_user_can_neither_read_the_token_nor_get_it_from_the_daemon() {
    if not_root() {
        eprintln!("SKIPPED: making another user needs root");
        return;
    }
    let user = OtherUser::new();
    let t = tmp();
    // Everything on the way is open to others; only the state directory stands in the way.
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut a = Device::new(&t, "a");
    a.start();
    let url = page_url(&a);
    let (port, token) = port_and_token(&url);
    let token_file = a.home.join("state/ui-token");
    let read = user.run(&["cat", token_file.to_str().unwrap()]);
    assert!(!read.status.success());
    assert!(
        String::from_utf8_lossy(&read.stderr).contains("Permission denied"),
        "{read:?}"
    );
    let list = user.run(&["ls", a.home.join("state").to_str().unwrap()]);
    assert!(!list.status.success(), "{list:?}");
    // Its own `meshfs ui` against this home: refused before it can ask the daemon.
    let runs = user.run(&[bin(), "--version"]).status.success();
    if runs {
        let ui = user.run(&[
            bin(),
            "--home",
            a.home.to_str().unwrap(),
            "ui",
            "--print-url",
        ]);
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&ui.stdout),
            String::from_utf8_lossy(&ui.stderr)
        );
        assert!(!ui.status.success(), "{out}");
        assert!(
            !out.contains(&token) && out.contains("Permission denied"),
            "{out}"
        );
    } else {
        eprintln!(
            "note: {} is not executable by another user; its `meshfs ui` is not tried",
            bin()
        );
    }
    // And what it can reach, the port, answers it 401 without the token.
    let probe = user.run(&[
        "bash",
        "-c",
        &format!(
            "exec 3<>/dev/tcp/127.0.0.1/{port}; printf 'GET / HTTP/1.1\\r\\nHost: 127.0.0.1:{port}\\r\\n\\r\\n' >&3; head -c 12 <&3"
        ),
    ]);
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout),
        "HTTP/1.1 401",
        "{probe:?}"
    );
}

/// Whether this process is not root (then no user can be made).
fn not_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() != 0 }
}

#[test]
fn meshfs_ui_without_a_daemon_exits_3_and_says_the_daemon_serves_the_page() {
    let t = tmp();
    let a = Device::new(&t, "a");
    let out = meshfs(&a.home, &["ui", "--print-url"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the page is served by it"));
}
