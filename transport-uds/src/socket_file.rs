//! The socket file and its lock file: when a listener may create, replace and remove them.
//!
//! A listener holds an exclusive `flock` on `<path>.lock` for its whole life. Only a process
//! holding that lock touches the socket path, and it replaces a socket found there only when
//! connecting to it is refused (nobody listens on it, even a listener that does not know about
//! the lock). Each listener removes, on drop, only the files it created (same device and inode).

use std::ffi::OsString;
use std::fs::{File, Metadata, OpenOptions, Permissions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};

use socket2::{Domain, SockAddr, Socket, Type};

/// How many times a listener reopens a lock file that was replaced between its `open` and its
/// `flock` before giving up.
const LOCK_ATTEMPTS: usize = 8;

/// A file's identity: it survives renames, and a new file at the same path has another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(m: &Metadata) -> FileId {
        FileId {
            dev: m.dev(),
            ino: m.ino(),
        }
    }

    /// The file now at `path` (a symlink itself, not its target), if any.
    fn at(path: &Path) -> io::Result<Option<FileId>> {
        match std::fs::symlink_metadata(path) {
            Ok(m) => Ok(Some(FileId::of(&m))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Removes `path` if it is still the file `id`. Best effort: for `Drop` and error paths.
pub(crate) fn remove_if_same(path: &Path, id: FileId) {
    if let Ok(Some(now)) = FileId::at(path) {
        if now == id {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The lock file of the socket at `socket`: `<socket>.lock`.
pub(crate) fn lock_path(socket: &Path) -> PathBuf {
    let mut p = OsString::from(socket.as_os_str());
    p.push(".lock");
    PathBuf::from(p)
}

fn context(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn in_use(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::AddrInUse, msg)
}

/// An exclusive `flock` on the lock file of a socket path, held as long as this value lives.
#[derive(Debug)]
pub(crate) struct PathLock {
    /// Held, never read: closing it releases the lock.
    _file: File,
    path: PathBuf,
    id: FileId,
}

impl PathLock {
    /// Takes the lock of `socket` without waiting: `AddrInUse` if another listener holds it.
    pub(crate) fn acquire(socket: &Path) -> io::Result<PathLock> {
        let path = lock_path(socket);
        for _ in 0..LOCK_ATTEMPTS {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o600)
                // A symlink planted at the lock path must not make us create or lock a file
                // elsewhere.
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(|e| context(e, format_args!("lock file {}", path.display())))?;
            let meta = file.metadata()?;
            if !meta.file_type().is_file() {
                return Err(in_use(format!(
                    "{} is in use: its lock file {} is not a regular file",
                    socket.display(),
                    path.display()
                )));
            }
            if !try_lock_exclusive(&file)
                .map_err(|e| context(e, format_args!("flock {}", path.display())))?
            {
                return Err(in_use(format!(
                    "{} is in use: another listener holds its lock file {}",
                    socket.display(),
                    path.display()
                )));
            }
            let id = FileId::of(&meta);
            if FileId::at(&path)? == Some(id) {
                return Ok(PathLock {
                    _file: file,
                    path,
                    id,
                });
            }
            // The holder removed the file (or someone replaced it) between our open and our
            // flock: we locked an orphan nobody else will look at. Start over with the file now
            // at the path.
        }
        Err(in_use(format!(
            "{} is in use: its lock file {} was replaced {LOCK_ATTEMPTS} times while locking it",
            socket.display(),
            path.display()
        )))
    }
}

impl Drop for PathLock {
    fn drop(&mut self) {
        // Unlink while still holding the lock, so that whoever locks the old file next sees that
        // it is no longer at the path and starts over. The lock goes with `self._file`, dropped
        // after this.
        remove_if_same(&self.path, self.id);
    }
}

/// `flock(LOCK_EX | LOCK_NB)`: true when taken, false when someone else holds it.
fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: flock takes a descriptor number and flags and touches no memory of ours; the
        // descriptor stays open for the call because `file` is borrowed.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock => return Ok(false),
            io::ErrorKind::Interrupted => continue,
            _ => return Err(e),
        }
    }
}

/// Makes `path` free to bind, holding its lock: nothing is there, or a socket nobody listens on
/// is there and is removed. Anything else is left alone and is an error.
fn clear_stale_socket(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(in_use(format!(
            "{} exists and is not a socket; it is left alone",
            path.display()
        )));
    }
    // Nobody holds the lock, but a listener that does not take it (another program, an older
    // version) may still serve this socket: only a refused connection proves it stale. A full
    // backlog answers `WouldBlock`, which is a live listener too.
    let probe = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    probe.set_nonblocking(true)?;
    match probe.connect(&SockAddr::unix(path)?) {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Ok(()) => {
            return Err(in_use(format!(
                "{} is in use: a listener that does not hold {} accepts on it",
                path.display(),
                lock_path(path).display()
            )))
        }
        Err(e) => {
            return Err(in_use(format!(
                "{} is in use: connecting to it gave `{e}`, so it is not provably stale",
                path.display()
            )))
        }
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A bound, listening, non-blocking socket at its path, with its lock.
pub(crate) struct BoundSocket {
    pub(crate) listener: StdUnixListener,
    pub(crate) id: FileId,
    pub(crate) lock: PathLock,
}

/// Takes the lock of `path`, clears a stale socket there, binds, sets the file's permission bits
/// to `mode` and only then listens, so nobody connects while the file has other permissions.
pub(crate) fn bind(path: &Path, mode: u32, backlog: i32) -> io::Result<BoundSocket> {
    if mode & !0o777 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket mode {mode:#o} has bits outside 0o777"),
        ));
    }
    let lock = PathLock::acquire(path)?;
    clear_stale_socket(path)?;
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.bind(&SockAddr::unix(path)?)?;
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::other(format!(
            "{} is no longer the socket just bound",
            path.display()
        )));
    }
    let id = FileId::of(&meta);
    let listen = || -> io::Result<()> {
        std::fs::set_permissions(path, Permissions::from_mode(mode))
            .map_err(|e| context(e, format_args!("chmod {mode:#o} {}", path.display())))?;
        socket.listen(backlog)?;
        socket.set_nonblocking(true)
    };
    if let Err(e) = listen() {
        remove_if_same(path, id);
        return Err(e);
    }
    Ok(BoundSocket {
        listener: socket.into(),
        id,
        lock,
    })
}
