//! Transport URIs: `tcp://HOST:PORT`, `unix:PATH`, `verbs://IP:PORT`.

use crate::status::Failure;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

/// Where to connect or listen, and over what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `tcp://HOST:PORT` (a name is resolved; the first address is used).
    Tcp(SocketAddr),
    /// `unix:PATH`.
    Unix(PathBuf),
    /// `verbs://IP:PORT`: an address of the RDMA device's interface.
    Verbs(SocketAddr),
}

impl Endpoint {
    /// Parses a URI; the error says what is wrong with it.
    pub(crate) fn parse(uri: &str) -> Result<Endpoint, Failure> {
        let bad = |why: &str| Failure::arg(format!("URI `{uri}`: {why}"));
        if let Some(path) = uri.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("no socket path after `unix:`"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("expected tcp://HOST:PORT, unix:PATH or verbs://IP:PORT"))?;
        let addr = || -> Result<SocketAddr, Failure> {
            rest.to_socket_addrs()
                .map_err(|e| bad(&format!("not HOST:PORT ({e})")))?
                .next()
                .ok_or_else(|| bad("the host resolves to no address"))
        };
        match scheme {
            "tcp" => Ok(Endpoint::Tcp(addr()?)),
            "verbs" => Ok(Endpoint::Verbs(rest.parse().map_err(|_| {
                bad("verbs takes an IP address and a port, not a name")
            })?)),
            other => Err(bad(&format!("unknown scheme `{other}` (tcp, unix, verbs)"))),
        }
    }

    /// The URI of this endpoint (the bound address of a listener, port included).
    pub(crate) fn uri(&self) -> String {
        match self {
            Endpoint::Tcp(a) => format!("tcp://{a}"),
            Endpoint::Unix(p) => format!("unix:{}", p.display()),
            Endpoint::Verbs(a) => format!("verbs://{a}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_schemes_parse_and_print_back() {
        for uri in [
            "tcp://127.0.0.1:7",
            "unix:/tmp/x.sock",
            "verbs://10.0.0.1:7471",
        ] {
            assert_eq!(Endpoint::parse(uri).unwrap().uri(), uri);
        }
        assert_eq!(
            Endpoint::parse("tcp://[::1]:9").unwrap(),
            Endpoint::Tcp("[::1]:9".parse().unwrap())
        );
    }

    #[test]
    fn bad_uris_are_argument_errors_that_say_why() {
        for (uri, why) in [
            ("", "expected"),
            ("unix:", "no socket path"),
            ("udp://1.2.3.4:5", "unknown scheme"),
            ("tcp://nohost", "not HOST:PORT"),
            ("verbs://rdma-host:1", "IP address"),
        ] {
            let e = Endpoint::parse(uri).unwrap_err();
            assert_eq!(e.status, crate::tp_status::TP_ERR_INVALID_ARGUMENT);
            assert!(e.message.contains(why), "{uri}: {}", e.message);
        }
    }
}
