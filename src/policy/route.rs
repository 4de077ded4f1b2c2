//! Route matching: (host, method, path, headers) -> the first route that
//! matches, in file order. Pure: no I/O, no allocation per request.

use http::{HeaderMap, HeaderName, HeaderValue, Method};

use crate::policy::settings::MatchConfig;

/// A compiled `match = { ... }` table. Every condition given must hold.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    /// Any one of them; empty: any host.
    hosts: Vec<HostMatch>,
    path: Option<String>,
    path_prefix: Option<String>,
    methods: Option<Vec<Method>>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

#[derive(Debug, Clone)]
enum HostMatch {
    /// `example.com`: the host part, any port.
    Host(String),
    /// `example.com:8080`: host and port.
    Authority(String),
    /// `*.example.com`: any subdomain (the leading dot kept).
    Suffix(String),
}

/// Why a match table could not be compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidMatch {
    /// `path` or `path_prefix`.
    #[error("{1:?} must start with '/'")]
    Path(&'static str, String),
    #[error("{0:?} is not a host name")]
    Host(String),
    #[error("{0:?}: a wildcard is a leading \"*.\" before a domain (\"*.example.com\"), and nowhere else")]
    Wildcard(String),
    #[error("{0:?} is not a header name")]
    HeaderName(String),
    #[error("{value:?} is not a header value")]
    HeaderValue { name: String, value: String },
}

/// What a matcher looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// The request's authority (`host[:port]`), from the URI or the Host header.
    pub host: Option<&'a str>,
    pub method: &'a Method,
    pub path: &'a str,
    pub headers: &'a HeaderMap,
}

impl Matcher {
    /// Compiles a match table, or names what in it is wrong.
    pub fn try_new(m: &MatchConfig) -> Result<Self, InvalidMatch> {
        for (key, value) in [("path", &m.path), ("path_prefix", &m.path_prefix)] {
            if let Some(p) = value {
                if !p.starts_with('/') {
                    return Err(InvalidMatch::Path(key, p.clone()));
                }
            }
        }
        let hosts = m
            .host
            .iter()
            .flat_map(|hosts| hosts.0.iter())
            .map(|h| host_match(h))
            .collect::<Result<Vec<_>, _>>()?;
        let methods = m
            .methods
            .as_ref()
            .map(|ms| ms.iter().map(|m| m.0.clone()).collect());
        let headers = m
            .headers
            .iter()
            .map(|(k, v)| {
                let name = HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| InvalidMatch::HeaderName(k.clone()))?;
                let value = HeaderValue::from_str(v).map_err(|_| InvalidMatch::HeaderValue {
                    name: k.clone(),
                    value: v.clone(),
                })?;
                Ok((name, value))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            hosts,
            path: m.path.clone(),
            path_prefix: m.path_prefix.clone(),
            methods,
            headers,
        })
    }

    /// Whether it matches on the request's host (`match.host`).
    pub fn by_host(&self) -> bool {
        !self.hosts.is_empty()
    }

    pub fn matches(&self, req: &RequestInfo<'_>) -> bool {
        if let Some(path) = &self.path {
            if req.path != path {
                return false;
            }
        }
        if let Some(prefix) = &self.path_prefix {
            if !req.path.starts_with(prefix.as_str()) {
                return false;
            }
        }
        if let Some(methods) = &self.methods {
            if !methods.contains(req.method) {
                return false;
            }
        }
        if !self.hosts.is_empty() {
            let Some(authority) = req.host else {
                return false;
            };
            if !self.hosts.iter().any(|h| h.matches(authority)) {
                return false;
            }
        }
        self.headers
            .iter()
            .all(|(name, value)| req.headers.get_all(name).iter().any(|v| v == value))
    }
}

/// One host of `match.host`, compiled.
fn host_match(written: &str) -> Result<HostMatch, InvalidMatch> {
    // A name the request's host is compared with once its trailing dot is
    // gone (`inventory.` is `inventory`); userinfo is never in a `Host`.
    let h = without_root_dot(written);
    if h.is_empty() || h.contains('@') || h.parse::<http::uri::Authority>().is_err() {
        return Err(InvalidMatch::Host(written.to_owned()));
    }
    let h = h.to_ascii_lowercase();
    let wildcard = h.strip_prefix("*.").map(|domain| format!(".{domain}"));
    if wildcard.as_deref().unwrap_or(&h).contains('*') || wildcard.as_deref() == Some(".") {
        return Err(InvalidMatch::Wildcard(written.to_owned()));
    }
    Ok(if let Some(suffix) = wildcard {
        HostMatch::Suffix(suffix)
    } else if h.contains(':') && !h.ends_with(']') {
        HostMatch::Authority(h)
    } else {
        HostMatch::Host(h)
    })
}

impl HostMatch {
    fn matches(&self, authority: &str) -> bool {
        match self {
            HostMatch::Authority(a) => authority.eq_ignore_ascii_case(a),
            HostMatch::Host(h) => without_root_dot(strip_port(authority)).eq_ignore_ascii_case(h),
            HostMatch::Suffix(suffix) => {
                let host = without_root_dot(strip_port(authority));
                host.len() > suffix.len()
                    && host.as_bytes()[host.len() - suffix.len()..]
                        .eq_ignore_ascii_case(suffix.as_bytes())
            }
        }
    }
}

/// A host as written, less the trailing dot of a fully qualified name
/// (`inventory.` is `inventory`).
fn without_root_dot(host: &str) -> &str {
    host.strip_suffix('.').unwrap_or(host)
}

/// `path` with its dot segments removed (RFC 3986 §5.2.4), `%2e` read as
/// the `.` it encodes (§6.2.2.2): `/a/../b` and `/a/%2E%2e/b` are `/b`, and
/// `..` never climbs above the root. What routes match, and what is joined
/// to an endpoint's base path: a caller cannot step out of either. Borrowed
/// when there is nothing to remove.
pub fn without_dot_segments(path: &str) -> std::borrow::Cow<'_, str> {
    let dotted = |s: &str| s == "." || s.eq_ignore_ascii_case("%2e");
    let dotdot = |s: &str| {
        s == ".."
            || [".%2e", "%2e.", "%2e%2e"]
                .iter()
                .any(|d| s.eq_ignore_ascii_case(d))
    };
    let Some(rest) = path.strip_prefix('/') else {
        return path.into(); // `*`, or no path
    };
    // A dot segment begins with `.` or `%` after a `/`: most paths have
    // neither byte at all, and are passed over in one look at their bytes.
    let bytes = path.as_bytes();
    let may_have_dots = bytes.iter().any(|b| matches!(b, b'.' | b'%'))
        && bytes
            .windows(2)
            .any(|w| w[0] == b'/' && matches!(w[1], b'.' | b'%'));
    if !may_have_dots || !rest.split('/').any(|s| dotted(s) || dotdot(s)) {
        return path.into();
    }
    let mut kept: Vec<&str> = Vec::new();
    let mut ends_in_dir = false;
    for segment in rest.split('/') {
        ends_in_dir = false;
        if dotted(segment) {
            ends_in_dir = true;
        } else if dotdot(segment) {
            kept.pop();
            ends_in_dir = true;
        } else {
            kept.push(segment);
        }
    }
    let mut out = String::with_capacity(path.len());
    for segment in &kept {
        out.push('/');
        out.push_str(segment);
    }
    if ends_in_dir || out.is_empty() {
        out.push('/');
    }
    out.into()
}

fn strip_port(authority: &str) -> &str {
    if authority.ends_with(']') {
        return authority; // [v6] without a port
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Index of the first matcher that takes the request.
pub fn first_match<'a, T>(
    routes: impl IntoIterator<Item = &'a T>,
    matcher: impl Fn(&T) -> &Matcher,
    req: &RequestInfo<'_>,
) -> Option<&'a T>
where
    T: 'a,
{
    routes.into_iter().find(|r| matcher(r).matches(req))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::policy::settings::MethodName;

    fn compile(m: &MatchConfig) -> Matcher {
        Matcher::try_new(m).unwrap()
    }

    fn info<'a>(
        host: Option<&'a str>,
        method: &'a Method,
        path: &'a str,
        headers: &'a HeaderMap,
    ) -> RequestInfo<'a> {
        RequestInfo {
            host,
            method,
            path,
            headers,
        }
    }

    #[test]
    fn empty_match_takes_everything() {
        let m = compile(&MatchConfig::default());
        let h = HeaderMap::new();
        assert!(m.matches(&info(None, &Method::POST, "/x", &h)));
    }

    #[test]
    fn dot_segments_are_removed_and_never_climb_above_the_root() {
        for (path, want) in [
            ("/plain/path", "/plain/path"),
            ("/", "/"),
            ("*", "*"),
            ("/a/../b", "/b"),
            ("/a/./b", "/a/b"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/../../etc", "/etc"),
            ("/a/../../etc", "/etc"),
            ("/a/%2e%2e/%2E%2E/x", "/x"),
            ("/a/.%2e/x", "/x"),
            ("/a/%2e/x", "/a/x"),
            ("/..", "/"),
            ("/a/..b/c", "/a/..b/c"),
            ("/a//../b", "/a/b"),
        ] {
            assert_eq!(without_dot_segments(path), want, "{path}");
        }
        assert!(matches!(
            without_dot_segments("/no/dots"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn host_forms() {
        let h = HeaderMap::new();
        let get = Method::GET;
        let host = |s: &str| {
            compile(&MatchConfig {
                host: Some(s.into()),
                ..Default::default()
            })
        };
        assert!(host("API.example.com").matches(&info(
            Some("api.example.COM:8080"),
            &get,
            "/",
            &h
        )));
        assert!(!host("api.example.com").matches(&info(Some("web.example.com"), &get, "/", &h)));
        assert!(!host("api.example.com").matches(&info(None, &get, "/", &h)));
        assert!(host("api.example.com:8080").matches(&info(
            Some("api.example.com:8080"),
            &get,
            "/",
            &h
        )));
        assert!(!host("api.example.com:8080").matches(&info(
            Some("api.example.com:9090"),
            &get,
            "/",
            &h
        )));
        assert!(host("*.example.com").matches(&info(Some("a.b.example.com"), &get, "/", &h)));
        assert!(!host("*.example.com").matches(&info(Some("example.com"), &get, "/", &h)));
        assert!(host("[::1]").matches(&info(Some("[::1]:80"), &get, "/", &h)));
        // A trailing dot is the same name.
        assert!(host("A.COM.").matches(&info(Some("a.com"), &get, "/", &h)));
        assert!(host("a.com").matches(&info(Some("a.com."), &get, "/", &h)));
    }

    #[test]
    fn hosts_that_could_never_match_are_refused() {
        for bad in [
            "user@host",
            "x.*",
            "*.*.com",
            "*example.com",
            "*.",
            "a*.com",
        ] {
            let m = MatchConfig {
                host: Some(bad.into()),
                ..Default::default()
            };
            assert!(Matcher::try_new(&m).is_err(), "{bad}");
        }
    }

    #[test]
    fn path_method_and_headers() {
        let mut headers = BTreeMap::new();
        headers.insert("x-env".to_owned(), "canary".to_owned());
        let m = compile(&MatchConfig {
            path_prefix: Some("/v1/".into()),
            methods: Some(vec![MethodName(Method::POST)]),
            headers,
            ..Default::default()
        });
        let mut h = HeaderMap::new();
        assert!(
            !m.matches(&info(None, &Method::POST, "/v1/orders", &h)),
            "header missing"
        );
        h.insert("x-env", HeaderValue::from_static("canary"));
        assert!(m.matches(&info(None, &Method::POST, "/v1/orders", &h)));
        assert!(!m.matches(&info(None, &Method::GET, "/v1/orders", &h)));
        assert!(!m.matches(&info(None, &Method::POST, "/v2/orders", &h)));

        let exact = compile(&MatchConfig {
            path: Some("/health".into()),
            ..Default::default()
        });
        assert!(exact.matches(&info(None, &Method::GET, "/health", &h)));
        assert!(!exact.matches(&info(None, &Method::GET, "/health/x", &h)));
    }

    #[test]
    fn first_match_wins() {
        let routes = [
            (
                "specific",
                compile(&MatchConfig {
                    path_prefix: Some("/a/b".into()),
                    ..Default::default()
                }),
            ),
            (
                "broad",
                compile(&MatchConfig {
                    path_prefix: Some("/a".into()),
                    ..Default::default()
                }),
            ),
        ];
        let h = HeaderMap::new();
        let pick =
            |path| first_match(&routes, |r| &r.1, &info(None, &Method::GET, path, &h)).map(|r| r.0);
        assert_eq!(pick("/a/b/c"), Some("specific"));
        assert_eq!(pick("/a/x"), Some("broad"));
        assert_eq!(pick("/z"), None);
    }
}
