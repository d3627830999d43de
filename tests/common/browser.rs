//! A real browser for the page's tests: Debian's headless `chromium`, driven through
//! `chromedriver` over the WebDriver protocol (plain HTTP and JSON on loopback), so a test
//! loads the page, types into it, clicks, reads what a person would see and keeps screenshots.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The W3C name of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The browser and its driver, when this machine has both; `None` after saying why not.
pub fn chromium() -> Option<(PathBuf, PathBuf)> {
    let find = |names: &[&str]| {
        names.iter().find_map(|n| {
            ["/usr/bin", "/usr/local/bin", "/snap/bin"]
                .iter()
                .map(|d| Path::new(d).join(n))
                .find(|p| p.exists())
        })
    };
    match (find(&["chromium"]), find(&["chromedriver"])) {
        (Some(b), Some(d)) => Some((b, d)),
        _ => {
            eprintln!(
                "SKIPPED: the browser test needs Debian's chromium and chromium-driver \
                 (`apt-get install chromium chromium-driver`; .ci/run installs them)"
            );
            None
        }
    }
}

/// Where the tests keep their screenshots.
pub fn screenshot_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running chromedriver with one browser session; both end on drop.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless chromium `width`×`height` pixels.
    pub fn start(binary: &Path, driver: &Path, width: u32, height: u32) -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile::tempdir().unwrap();
        let mut b = Browser {
            driver,
            port,
            session: String::new(),
            _profile: profile,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while b.call("GET", "/status", None).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        let args = [
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", b._profile.path().display()),
        ];
        let caps = serde_json::json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": binary, "args": args},
        }}});
        let v = b.call("POST", "/session", Some(caps)).expect("new session");
        b.session = v["sessionId"].as_str().expect("a session id").to_string();
        b
    }

    /// One WebDriver command; its `value`, or the error it answered.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<serde_json::Value, String> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.port,
            body.len()
        )
        .map_err(|e| e.to_string())?;
        // chromedriver says `Connection: close` but keeps the connection open: read the head,
        // then exactly `Content-Length` bytes.
        let mut raw = Vec::new();
        let mut buf = [0u8; 8192];
        let (head, json) = loop {
            let n = s.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("chromedriver closed the connection".into());
            }
            raw.extend_from_slice(&buf[..n]);
            let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&raw[..end]).to_string();
            let length = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if raw.len() >= end + 4 + length {
                let body = String::from_utf8_lossy(&raw[end + 4..end + 4 + length]).to_string();
                break (head, body);
            }
        };
        let v: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| format!("{e}: {json}"))?;
        if head.starts_with("HTTP/1.1 200") {
            Ok(v["value"].clone())
        } else {
            Err(v.to_string())
        }
    }

    fn session_call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let path = format!("/session/{}{path}", self.session);
        self.call(method, &path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// Loads `url` (and waits for its load event, as WebDriver does).
    pub fn go(&self, url: &str) {
        self.session_call("POST", "/url", Some(serde_json::json!({ "url": url })));
    }

    /// Runs `script` (a function body; `return` gives its value) in the page.
    pub fn js(&self, script: &str) -> serde_json::Value {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(serde_json::json!({"script": script, "args": []})),
        )
    }

    /// Waits until `script` returns true, or panics after `secs` with what `show` returns.
    pub fn wait_for(&self, what: &str, secs: u64, script: &str, show: &str) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if self.js(script) == serde_json::Value::Bool(true) {
                return;
            }
            if Instant::now() > deadline {
                panic!("the page never showed {what}; it shows:\n{}", self.js(show));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The element `css` selects (it must exist).
    fn element(&self, css: &str) -> String {
        let v = self.session_call(
            "POST",
            "/element",
            Some(serde_json::json!({"using": "css selector", "value": css})),
        );
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {v}"))
            .to_string()
    }

    /// Types `text` into the field `css` selects, as a person would (after clearing it).
    pub fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css);
        self.session_call(
            "POST",
            &format!("/element/{e}/clear"),
            Some(serde_json::json!({})),
        );
        self.session_call(
            "POST",
            &format!("/element/{e}/value"),
            Some(serde_json::json!({ "text": text })),
        );
    }

    /// Clicks what `css` selects. The page redraws itself as the daemon's state changes: an
    /// element redrawn between finding and clicking it is found again (a few times).
    pub fn click(&self, css: &str) {
        for _ in 0..5 {
            let e = self.element(css);
            let path = format!("/session/{}/element/{e}/click", self.session);
            match self.call("POST", &path, Some(serde_json::json!({}))) {
                Ok(_) => return,
                Err(e) if e.contains("stale element reference") => {
                    std::thread::sleep(std::time::Duration::from_millis(50))
                }
                Err(e) => panic!("POST {path}: {e}"),
            }
        }
        panic!("{css} was redrawn at each of five clicks");
    }

    /// Sets the window's size in CSS pixels.
    pub fn resize(&self, width: u32, height: u32) {
        self.session_call(
            "POST",
            "/window/rect",
            Some(serde_json::json!({"width": width, "height": height})),
        );
    }

    /// Saves a screenshot of the window as `name` in [`screenshot_dir`]; returns its path.
    pub fn screenshot(&self, name: &str) -> PathBuf {
        let v = self.session_call("GET", "/screenshot", None);
        let png = data_encoding::BASE64
            .decode(v.as_str().expect("base64").as_bytes())
            .expect("a PNG");
        let path = screenshot_dir().join(name);
        std::fs::write(&path, png).unwrap();
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.call("DELETE", &format!("/session/{}", self.session), None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
