//! The value types and parsers of the bench's command line, shared by every command: CPU
//! placement, transports, sizes, and where `bench client` and `bench count` find a server.

use crate::proto;
use clap::ValueEnum;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Default TCP port of `bench server`.
pub(crate) const DEFAULT_PORT: u16 = 5201;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Pin {
    /// Client threads and server on the same CPU (the most repeatable placement).
    Same,
    /// Client on one CPU, server on another.
    Split,
    /// No pinning: the scheduler decides.
    None,
}

/// What `--only` restricts a run to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Only {
    /// The RPC path alone: no raw backend connection, no os or link baseline.
    Rpc,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RemoteTransport {
    Uds,
    Tcp,
    Verbs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TransportName {
    Uds,
    Tcp,
    Verbs,
    /// Shared memory (transport-shm), set up over a Unix socket; its OS baseline is the Unix
    /// socket's.
    Shm,
}

pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let n = parse_bytes(s)?;
    if n > proto::MAX_PAYLOAD {
        return Err(format!(
            "`{s}` is above the largest supported size of {} bytes",
            proto::MAX_PAYLOAD
        ));
    }
    Ok(n)
}

pub(crate) fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (digits, mult) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1024),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        _ => (t, 1),
    };
    let n: usize = digits
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (examples: 1024, 64K, 1M)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}

pub(crate) fn resolve(host: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let with_port = if host.parse::<SocketAddr>().is_ok()
        || host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.contains(':') && p.parse::<u16>().is_ok())
    {
        host.to_string()
    } else if host.contains(':') {
        format!("[{host}]:{DEFAULT_PORT}")
    } else {
        format!("{host}:{DEFAULT_PORT}")
    };
    with_port
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{host}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{host}` resolves to no address"))
}

/// Where `bench client` finds its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Remote {
    /// A Unix socket path (`bench server --uds PATH`).
    Uds(PathBuf),
    /// TCP or verbs at this address.
    Ip(RemoteTransport, SocketAddr),
}

impl Remote {
    /// `host` with `--transport`: `unix:PATH` means uds; `--transport uds` takes a path with or
    /// without the prefix; anything else is HOST[:PORT] for tcp (default) or verbs.
    pub(crate) fn parse(host: &str, transport: Option<RemoteTransport>) -> Result<Remote, String> {
        let unix = host.strip_prefix("unix:");
        let uds =
            transport == Some(RemoteTransport::Uds) || (transport.is_none() && unix.is_some());
        if uds {
            let path = unix.unwrap_or(host);
            if path.is_empty() {
                return Err("empty Unix socket path: give unix:PATH".into());
            }
            return Ok(Remote::Uds(PathBuf::from(path)));
        }
        if unix.is_some() {
            return Err(format!(
                "`{host}` is a Unix socket: --transport tcp and verbs need HOST[:PORT]"
            ));
        }
        Ok(Remote::Ip(
            transport.unwrap_or(RemoteTransport::Tcp),
            resolve(host)?,
        ))
    }

    /// Where the server runs, for the placement line.
    pub(crate) fn server_where(&self) -> &'static str {
        match self {
            Remote::Uds(_) => "server in another process on this host",
            Remote::Ip(_, a) if a.ip().is_loopback() => "server in another process on this host",
            Remote::Ip(..) => "server on the remote host",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("500000"), Ok(500_000));
        assert!(parse_size("12x").is_err());
        assert!(parse_size("17M").is_err());
    }

    /// `bench client` reaches a Unix socket with `unix:PATH` (or `--transport uds PATH`),
    /// refuses a Unix socket with tcp or verbs, and says where the server is truthfully.
    #[test]
    fn client_targets_parse_and_say_where_the_server_is() {
        let p = |h: &str, t| Remote::parse(h, t);
        assert_eq!(
            p("unix:/tmp/b.sock", None),
            Ok(Remote::Uds("/tmp/b.sock".into()))
        );
        assert_eq!(
            p("/tmp/b.sock", Some(RemoteTransport::Uds)),
            Ok(Remote::Uds("/tmp/b.sock".into()))
        );
        assert!(p("unix:", None).is_err());
        assert!(p("unix:/tmp/b.sock", Some(RemoteTransport::Tcp)).is_err());
        assert!(p("unix:/tmp/b.sock", Some(RemoteTransport::Verbs)).is_err());
        let tcp = p("127.0.0.1", None).unwrap();
        assert!(matches!(tcp, Remote::Ip(RemoteTransport::Tcp, a) if a.port() == DEFAULT_PORT));
        assert_eq!(tcp.server_where(), "server in another process on this host");
        let verbs = p("192.0.2.7:9", Some(RemoteTransport::Verbs)).unwrap();
        assert!(matches!(verbs, Remote::Ip(RemoteTransport::Verbs, _)));
        assert_eq!(verbs.server_where(), "server on the remote host");
        assert_eq!(
            p("unix:/x", None).unwrap().server_where(),
            "server in another process on this host"
        );
    }

    #[test]
    fn host_gets_the_default_port() {
        assert_eq!(resolve("127.0.0.1").unwrap().port(), DEFAULT_PORT);
        assert_eq!(resolve("127.0.0.1:7").unwrap().port(), 7);
        assert_eq!(resolve("::1").unwrap().port(), DEFAULT_PORT);
        assert_eq!(resolve("[::1]:9").unwrap().port(), 9);
    }
}
