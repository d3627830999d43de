//! Who gets in (`docs/ui.md`, "Security"): every request must name this server by its
//! loopback address in `Host` (a page of another site whose name an attacker made resolve to
//! 127.0.0.1, DNS rebinding, sends its own name), and carry the token: once in the URL that
//! `meshfs ui` opens, from then on in an `HttpOnly`, `SameSite=Strict` cookie. A request that
//! changes something must also come from the page itself (`Origin`, `Sec-Fetch-Site`). Pure:
//! decides from the request alone, answers nothing.

use super::http::{encode, Request};

/// The token: 32 random bytes, as 64 hex digits. New at each start of serving.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// A fresh token from the operating system's random source (through `rand`'s CSPRNG).
    pub fn random() -> Token {
        let bytes: [u8; 32] = rand::random();
        Token(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The token as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `candidate` is the token, in time that does not depend on where they differ.
    pub fn matches(&self, candidate: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), candidate.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

/// The cookie's name: one per port, so two daemons of one machine (two homes) do not
/// overwrite each other's cookie (cookies do not tell ports apart).
pub fn cookie_name(port: u16) -> String {
    format!("meshfs-ui-{port}")
}

/// What to do with a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Refuse it with this status and nothing else: 403 for a foreign `Host` or a change
    /// asked from elsewhere, 401 without the token.
    Refuse(u16),
    /// The token came in the URL of a `GET`: set this cookie (a `Set-Cookie` value) and go on
    /// to `next`, the page with the same query without the token.
    Login {
        /// The `Set-Cookie` value.
        cookie: String,
        /// Where to go next.
        next: String,
    },
    /// Serve it.
    Pass,
}

/// Whether `req` may be served by the page on `127.0.0.1:port` whose token is `token`.
pub fn check(req: &Request, port: u16, token: &Token) -> Verdict {
    let Some(host) = our_host(req, port) else {
        return Verdict::Refuse(403);
    };
    if let Some(given) = req.param("token") {
        if req.method != "GET" || !token.matches(given) {
            return Verdict::Refuse(401);
        }
        let rest: Vec<String> = req
            .query
            .iter()
            .filter(|(n, _)| n != "token")
            .map(|(n, v)| format!("{}={}", encode(n), encode(v)))
            .collect();
        // Always the page itself: a login address never sends the browser anywhere else
        // (`//other.example` is another site).
        let next = if rest.is_empty() {
            "/".to_string()
        } else {
            format!("/?{}", rest.join("&"))
        };
        return Verdict::Login {
            cookie: format!(
                "{}={}; Path=/; HttpOnly; SameSite=Strict",
                cookie_name(port),
                token.as_str()
            ),
            next,
        };
    }
    if !has_cookie(req, port, token) {
        return Verdict::Refuse(401);
    }
    let reads_only = req.method == "GET" || req.method == "HEAD";
    if !reads_only && !same_origin(req, &host) {
        return Verdict::Refuse(403);
    }
    Verdict::Pass
}

/// The request's `Host` if it names this server by its loopback address (exactly one `Host`
/// header), in lower case.
fn our_host(req: &Request, port: u16) -> Option<String> {
    if req.header_count("host") != 1 {
        return None;
    }
    let host = req.header("host")?.to_ascii_lowercase();
    let ours = [format!("127.0.0.1:{port}"), format!("localhost:{port}")];
    let bare = port == 80 && (host == "127.0.0.1" || host == "localhost");
    (ours.contains(&host) || bare).then_some(host)
}

/// Whether a `Cookie` header carries our cookie with the token.
fn has_cookie(req: &Request, port: u16, token: &Token) -> bool {
    let name = cookie_name(port);
    req.headers
        .iter()
        .filter(|(n, _)| n == "cookie")
        .flat_map(|(_, v)| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(n, v)| n == name && token.matches(v))
}

/// Whether a request that changes something comes from the page itself: its `Origin` is this
/// server as the browser addressed it, and the browser does not say it came from elsewhere.
fn same_origin(req: &Request, host: &str) -> bool {
    let origin_ok = req
        .header("origin")
        .is_some_and(|o| o.eq_ignore_ascii_case(&format!("http://{host}")));
    let site_ok = req
        .header("sec-fetch-site")
        .is_none_or(|s| s == "same-origin");
    origin_ok && site_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    const PORT: u16 = 8384;

    fn req(method: &str, target: &str, headers: &[(&str, &str)]) -> Request {
        let mut head = format!("{method} {target} HTTP/1.1\r\n");
        for (n, v) in headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        head.push_str("\r\n");
        super::super::http::parse_head(head.as_bytes())
            .unwrap()
            .unwrap()
            .0
    }

    fn with_cookie(t: &Token) -> String {
        format!("other=1; {}={}", cookie_name(PORT), t.as_str())
    }

    #[test]
    fn a_token_in_the_url_logs_in_and_leaves_the_address_without_it() {
        let t = Token::random();
        let r = req(
            "GET",
            &format!("/?folder=work&token={}", t.as_str()),
            &[("Host", "127.0.0.1:8384")],
        );
        match check(&r, PORT, &t) {
            Verdict::Login { cookie, next } => {
                assert_eq!(next, "/?folder=work");
                assert_eq!(
                    cookie,
                    format!(
                        "meshfs-ui-8384={}; Path=/; HttpOnly; SameSite=Strict",
                        t.as_str()
                    )
                );
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_login_goes_on_to_the_page_and_nowhere_else() {
        let t = Token::random();
        let r = req(
            "GET",
            &format!("//evil.example/x?token={}", t.as_str()),
            &[("Host", "127.0.0.1:8384")],
        );
        assert!(matches!(check(&r, PORT, &t), Verdict::Login { next, .. } if next == "/"));
    }

    #[test]
    fn without_the_token_or_with_another_every_request_is_unauthorized() {
        let t = Token::random();
        let other = Token::random();
        let host = ("Host", "127.0.0.1:8384");
        let cookie = with_cookie(&other);
        for r in [
            req("GET", "/", &[host]),
            req("GET", "/events", &[host]),
            req("GET", "/app.js", &[host]),
            req("GET", "/nothing-here", &[host]),
            req("POST", "/scan?folder=work", &[host]),
            req("GET", &format!("/?token={}", other.as_str()), &[host]),
            req("GET", "/?token=", &[host]),
            req("GET", "/", &[host, ("Cookie", &cookie)]),
            // The token of this server under another port's cookie name.
            req(
                "GET",
                "/",
                &[host, ("Cookie", &format!("meshfs-ui-1={}", t.as_str()))],
            ),
            // A token in the URL logs in only with a GET.
            req("POST", &format!("/scan?token={}", t.as_str()), &[host]),
        ] {
            assert_eq!(check(&r, PORT, &t), Verdict::Refuse(401), "{r:?}");
        }
    }

    #[test]
    fn another_host_is_refused_even_with_the_token() {
        let t = Token::random();
        let cookie = with_cookie(&t);
        for host in [
            "evil.example:8384",
            "127.0.0.1:8385",
            "127.0.0.1",
            "[::1]:8384",
            "127.0.0.1:8384.evil.example",
        ] {
            let r = req("GET", "/", &[("Host", host), ("Cookie", &cookie)]);
            assert_eq!(check(&r, PORT, &t), Verdict::Refuse(403), "{host}");
        }
        let none = req("GET", "/", &[("Cookie", &cookie)]);
        assert_eq!(check(&none, PORT, &t), Verdict::Refuse(403));
        let two = req(
            "GET",
            "/",
            &[
                ("Host", "127.0.0.1:8384"),
                ("Host", "evil.example"),
                ("Cookie", &cookie),
            ],
        );
        assert_eq!(check(&two, PORT, &t), Verdict::Refuse(403));
        let login = req(
            "GET",
            &format!("/?token={}", t.as_str()),
            &[("Host", "evil.example:8384")],
        );
        assert_eq!(check(&login, PORT, &t), Verdict::Refuse(403));
    }

    #[test]
    fn reading_with_the_cookie_passes_on_either_loopback_name() {
        let t = Token::random();
        let cookie = with_cookie(&t);
        for host in ["127.0.0.1:8384", "localhost:8384", "LOCALHOST:8384"] {
            let r = req("GET", "/events", &[("Host", host), ("Cookie", &cookie)]);
            assert_eq!(check(&r, PORT, &t), Verdict::Pass, "{host}");
        }
    }

    #[test]
    fn a_change_needs_the_cookie_and_the_page_s_own_origin() {
        let t = Token::random();
        let cookie = with_cookie(&t);
        let host = ("Host", "127.0.0.1:8384");
        let post = |extra: &[(&str, &str)]| {
            let mut h = vec![host, ("Cookie", cookie.as_str())];
            h.extend_from_slice(extra);
            check(&req("POST", "/scan?folder=work", &h), PORT, &t)
        };
        assert_eq!(
            post(&[
                ("Origin", "http://127.0.0.1:8384"),
                ("Sec-Fetch-Site", "same-origin")
            ]),
            Verdict::Pass
        );
        assert_eq!(post(&[("Origin", "http://127.0.0.1:8384")]), Verdict::Pass);
        for bad in [
            vec![],
            vec![("Origin", "http://evil.example")],
            vec![("Origin", "null")],
            vec![("Origin", "http://localhost:8384")],
            vec![
                ("Origin", "http://127.0.0.1:8384"),
                ("Sec-Fetch-Site", "cross-site"),
            ],
            vec![
                ("Origin", "http://127.0.0.1:8384"),
                ("Sec-Fetch-Site", "same-site"),
            ],
        ] {
            assert_eq!(post(&bad), Verdict::Refuse(403), "{bad:?}");
        }
    }

    #[test]
    fn tokens_are_long_random_and_compared_whole() {
        let (a, b) = (Token::random(), Token::random());
        assert_eq!(a.as_str().len(), 64);
        assert!(!a.matches(b.as_str()));
        assert!(a.matches(a.as_str()));
        assert!(!a.matches(&a.as_str()[..63]));
        assert!(!a.matches(""));
        assert_eq!(format!("{a:?}"), "Token(…)");
    }
}
