//! Files under a directory loopd has checked: never through a symlink, never a FIFO or a device,
//! never a file with a second name, always private.
//!
//! Theory of operation: a [`Dir`] is an open directory descriptor. Every file loopd creates,
//! writes, appends to or reads under it is opened *relative to that descriptor* (`openat`) with
//! `O_NOFOLLOW` (a symlink in the last component is refused, not followed) and `O_NONBLOCK` (a FIFO
//! cannot block the open), then checked with `fstat`: it must be a regular file with exactly one
//! link (a hard link would let a write land in a file elsewhere). Subdirectories are opened the same
//! way, one component at a time, so a symlinked `{id}.progress` or `.loop` is refused too. Files
//! loopd creates are mode 0600 and directories 0700; an older file or directory of loopd's own with
//! group or other bits gets them removed when it is opened for writing. Reads are bounded by a cap.
//!
//! A repository can commit anything under `.loop/`; none of it can make loopd write outside the
//! directory, block on a read, or read without bound.
//!
//! Which layer may use which: this crate uses none of loopd's; every layer that writes a file (the
//! store, the executors' logs and result files, the trust records) uses it.

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{FileStat, Mode, SFlag};

/// Mode of the files loopd creates.
pub const FILE_MODE: u32 = 0o600;
/// Mode of the directories loopd creates.
pub const DIR_MODE: u32 = 0o700;
/// The suffix of temporary files of [`Dir::write_atomic`] and of the store.
pub const TEMP_SUFFIX: &str = ".tmp";

/// An open directory that files are opened relative to.
#[derive(Clone, Debug)]
pub struct Dir {
    fd: Arc<OwnedFd>,
    path: PathBuf,
}

/// Why a file was refused, as an `io::Error` of kind `InvalidInput` whose message says it in words.
fn refused(path: &Path, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} {what}; refused", path.display()),
    )
}

/// Whether an error is one of [`Dir`]'s refusals (a symlink, a FIFO, a hard link...).
pub fn is_refusal(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidInput
}

/// Whether `stat` is of a file loopd would open: a regular file with one link.
pub fn is_plain(stat: &FileStat) -> bool {
    describe(stat).is_none()
}

fn describe(stat: &FileStat) -> Option<&'static str> {
    let kind = SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits());
    match kind {
        SFlag::S_IFREG if stat.st_nlink > 1 => Some("has more than one link (a hard link)"),
        SFlag::S_IFREG => None,
        SFlag::S_IFDIR => Some("is a directory, not a regular file"),
        SFlag::S_IFIFO => Some("is a FIFO, not a regular file"),
        SFlag::S_IFLNK => Some("is a symlink (loopd never follows one here)"),
        SFlag::S_IFSOCK => Some("is a socket, not a regular file"),
        _ => Some("is a device, not a regular file"),
    }
}

impl Dir {
    /// Opens a directory the user named (the project root): it is trusted as given.
    pub fn open(path: &Path) -> io::Result<Dir> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| with_path(path, e.into()))?;
        Ok(Dir {
            fd: Arc::new(fd),
            path: path.to_owned(),
        })
    }

    /// Opens `rel` (one or more plain components) below this directory, one component at a time,
    /// creating what is missing when `create` is set. No component may be a symlink.
    pub fn open_nested(&self, rel: &Path, create: bool) -> io::Result<Dir> {
        let mut dir = self.clone();
        for part in rel.components() {
            match part {
                std::path::Component::Normal(name) => {
                    let name = name
                        .to_str()
                        .ok_or_else(|| refused(&dir.path.join(name), "is not a UTF-8 name"))?;
                    dir = dir.subdir(name, create)?;
                }
                std::path::Component::CurDir => {}
                _ => {
                    return Err(refused(
                        &self.path.join(rel),
                        "must be a relative path without '..'",
                    ));
                }
            }
        }
        Ok(dir)
    }

    /// Opens the subdirectory `name`, creating it (mode 0700) when `create` is set and it is
    /// missing. A symlink is refused.
    pub fn subdir(&self, name: &str, create: bool) -> io::Result<Dir> {
        let path = self.path.join(name);
        if create {
            match nix::sys::stat::mkdirat(&*self.fd, name, Mode::from_bits_truncate(DIR_MODE)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(with_path(&path, e.into())),
            }
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match nix::fcntl::openat(&*self.fd, name, flags, Mode::empty()) {
            Ok(fd) => Ok(Dir {
                fd: Arc::new(fd),
                path,
            }),
            Err(Errno::ELOOP | Errno::ENOTDIR) => Err(self.refusal(name)),
            Err(e) => Err(with_path(&path, e.into())),
        }
    }

    /// The filesystem this directory is on (`st_dev`).
    pub fn device(&self) -> Option<u64> {
        nix::sys::stat::fstat(&*self.fd).ok().map(|s| s.st_dev)
    }

    /// Whether this directory was removed since it was opened (it has no link left).
    pub fn removed(&self) -> bool {
        nix::sys::stat::fstat(&*self.fd).is_ok_and(|stat| stat.st_nlink == 0)
    }

    /// Makes a directory of loopd's own private (0700) if it is not.
    pub fn make_private(&self) {
        if let Ok(stat) = nix::sys::stat::fstat(&*self.fd)
            && stat.st_mode & 0o077 != 0
        {
            let _ = nix::sys::stat::fchmod(&*self.fd, Mode::from_bits_truncate(DIR_MODE));
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` in this directory, for messages and for other programs.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The error for an entry that is not what it should be, saying what it is.
    fn refusal(&self, name: &str) -> io::Error {
        let path = self.join(name);
        match self.stat(name) {
            Ok(Some(stat)) => refused(&path, describe(&stat).unwrap_or("is not a directory")),
            _ => refused(&path, "cannot be opened safely"),
        }
    }

    /// `name`'s own metadata (a symlink is reported as one), or `None` if it does not exist.
    pub fn stat(&self, name: &str) -> io::Result<Option<FileStat>> {
        match nix::sys::stat::fstatat(&*self.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(stat)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(with_path(&self.join(name), e.into())),
        }
    }

    /// Whether `name` exists (as anything).
    pub fn exists(&self, name: &str) -> bool {
        self.stat(name).is_ok_and(|s| s.is_some())
    }

    fn open_checked(&self, name: &str, flags: OFlag, private: bool) -> io::Result<File> {
        let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd =
            match nix::fcntl::openat(&*self.fd, name, flags, Mode::from_bits_truncate(FILE_MODE)) {
                Ok(fd) => fd,
                // ELOOP: a symlink; ENXIO: a FIFO without a reader, opened for writing.
                Err(Errno::ELOOP | Errno::ENXIO | Errno::EISDIR) => return Err(self.refusal(name)),
                Err(e) => return Err(with_path(&self.join(name), e.into())),
            };
        let stat = nix::sys::stat::fstat(&fd).map_err(|e| with_path(&self.join(name), e.into()))?;
        if let Some(what) = describe(&stat) {
            return Err(refused(&self.join(name), what));
        }
        if private && stat.st_mode & 0o077 != 0 {
            let _ = nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(FILE_MODE));
        }
        Ok(File::from(fd))
    }

    /// Opens a regular file for reading.
    pub fn open_read(&self, name: &str) -> io::Result<File> {
        self.open_checked(name, OFlag::O_RDONLY, false)
    }

    /// Reads a whole regular file, refusing (`FileTooLarge`) one over `cap` bytes.
    pub fn read(&self, name: &str, cap: u64) -> io::Result<Vec<u8>> {
        let file = self.open_read(name)?;
        read_capped(file, cap).map_err(|e| with_path(&self.join(name), e))
    }

    /// The last `want` bytes of a regular file, as text (a character cut at the start is
    /// replaced); `None` when it cannot be read.
    pub fn read_tail(&self, name: &str, want: u64) -> Option<String> {
        use std::io::{Read as _, Seek as _, SeekFrom};
        let mut file = self.open_read(name).ok()?;
        let len = file.metadata().ok()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(want))).ok()?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Opens a file for appending, creating it (0600) if missing.
    pub fn append(&self, name: &str) -> io::Result<File> {
        self.open_checked(
            name,
            OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_CREAT,
            true,
        )
    }

    /// Opens a file for writing from its start, created (0600) if missing, emptied if not.
    ///
    /// Emptied once it passed the checks (a hard link is refused untouched), and only if it holds
    /// anything: on ext4 a file cut to nothing has its writeback started by its close, at once
    /// (30 µs here, at the end of every attempt whose log was a new or emptied file).
    pub fn create(&self, name: &str) -> io::Result<File> {
        let file = self.open_checked(name, OFlag::O_WRONLY | OFlag::O_CREAT, true)?;
        if file.metadata()?.len() > 0 {
            file.set_len(0)?;
        }
        Ok(file)
    }

    /// Opens a file for reading and writing without changing it, created (0600) if missing: lock
    /// files.
    pub fn open_rw(&self, name: &str) -> io::Result<File> {
        self.open_checked(name, OFlag::O_RDWR | OFlag::O_CREAT, true)
    }

    /// Opens an existing regular file for reading and writing, without changing it: a file to
    /// write into again (see [`overwrite`]). Reusing a file spares the filesystem an inode's
    /// allocation and release per write, which is what a write costs most on ext4 without a
    /// journal: its search for a free inode skips every inode released in the last minutes.
    pub fn open_existing_rw(&self, name: &str) -> io::Result<File> {
        self.open_checked(name, OFlag::O_RDWR, true)
    }

    /// Creates a new temporary file next to `name` (`.NAME.PID-XXXXXX.tmp`, 0600, PID this
    /// process's, so that a sweep tells a living writer's file from one a dead writer left: see
    /// [`temp_writer`]); returns its name.
    pub fn temp_file(&self, name: &str) -> io::Result<(String, File)> {
        let pid = std::process::id();
        for _ in 0..100 {
            let tmp = format!(".{name}.{pid}-{}{TEMP_SUFFIX}", random_suffix());
            match self.open_checked(&tmp, OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL, true) {
                Ok(file) => return Ok((tmp, file)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{}: no free temporary name", self.join(name).display()),
        ))
    }

    /// Replaces `name` with `bytes`, as [`Dir::write_atomic`] without fsync, but writes into the
    /// version the last replacement took out (kept as `.NAME.spare.tmp`) rather than a new file:
    /// no inode is allocated or released per write (see [`Dir::open_existing_rw`]). A reader still
    /// holding a version two replacements old sees it change: for files people read, not for
    /// state.
    pub fn replace_reusing(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let spare = format!(".{name}.spare{TEMP_SUFFIX}");
        self.overwrite(&spare, bytes)?;
        match self.exchange(&spare, name) {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::Unsupported
                ) =>
            {
                self.rename(&spare, name)
            }
            Err(e) => Err(e),
        }
    }

    /// Makes `bytes` the content of `name`, created (0600) if missing, in place (see
    /// [`overwrite`]): a reader may see it half-written.
    pub fn overwrite(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let file = self.open_rw(name)?;
        overwrite(&file, bytes).map_err(|e| with_path(&self.join(name), e))
    }

    /// Replaces `name` with `bytes` atomically: a temporary file in this directory, renamed over
    /// it; `durable` adds an fsync of the file before and of the directory after the rename.
    pub fn write_atomic(&self, name: &str, bytes: &[u8], durable: bool) -> io::Result<()> {
        let (tmp, mut file) = self.temp_file(name)?;
        let written = file
            .write_all(bytes)
            .and_then(|()| if durable { file.sync_data() } else { Ok(()) });
        if let Err(e) = written.and_then(|()| self.rename(&tmp, name)) {
            let _ = self.remove(&tmp);
            return Err(with_path(&self.join(name), e));
        }
        if durable {
            self.sync()?;
        }
        Ok(())
    }

    /// Renames `from` to `to`, both in this directory.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        nix::fcntl::renameat(&*self.fd, from, &*self.fd, to)
            .map_err(|e| with_path(&self.join(to), e.into()))
    }

    /// Renames `from` to `to` unless `to` exists (`AlreadyExists` then): `renameat2(RENAME_NOREPLACE)`,
    /// else a look just before a plain rename.
    pub fn rename_new(&self, from: &str, to: &str) -> io::Result<()> {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        match nix::fcntl::renameat2(
            &*self.fd,
            from,
            &*self.fd,
            to,
            RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) => return Ok(()),
            Err(Errno::EEXIST) => return Err(io::ErrorKind::AlreadyExists.into()),
            Err(Errno::EINVAL | Errno::ENOSYS) => {}
            Err(e) => return Err(with_path(&self.join(to), e.into())),
        }
        if self.exists(to) {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        self.rename(from, to)
    }

    /// Swaps `a` and `b` atomically (`renameat2(RENAME_EXCHANGE)`); `Unsupported` where the
    /// kernel or filesystem cannot.
    pub fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            nix::fcntl::renameat2(&*self.fd, a, &*self.fd, b, RenameFlags::RENAME_EXCHANGE).map_err(
                |e| match e {
                    Errno::EINVAL | Errno::ENOSYS => io::ErrorKind::Unsupported.into(),
                    e => with_path(&self.join(b), e.into()),
                },
            )
        }
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        {
            let _ = (a, b, RenameFlags::empty());
            Err(io::ErrorKind::Unsupported.into())
        }
    }

    /// Removes the file `name`; a missing file is no error.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        match nix::unistd::unlinkat(&*self.fd, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(with_path(&self.join(name), e.into())),
        }
    }

    /// The names in this directory.
    pub fn entries(&self) -> io::Result<Vec<String>> {
        let fd = self.fd.try_clone().map_err(|e| with_path(&self.path, e))?;
        let mut dir = nix::dir::Dir::from_fd(fd).map_err(|e| with_path(&self.path, e.into()))?;
        Ok(dir
            .iter()
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str().ok().map(str::to_owned))
            .filter(|n| n != "." && n != "..")
            .collect())
    }

    /// fsync of the directory itself: makes renames and creations in it durable.
    pub fn sync(&self) -> io::Result<()> {
        nix::unistd::fsync(self.fd.as_fd()).map_err(|e| with_path(&self.path, e.into()))
    }
}

/// Makes `bytes` the whole content of `file`: written from its start, then cut to length where
/// it was longer. Not emptied first: on a disk mounted with `discard`, freeing the blocks of a
/// file written back costs a discard each time, where cutting a tail seldom frees a block. Not
/// cut where it was not longer: ext4 walks the file's extents at every truncate, even one to the
/// length the file has.
pub fn overwrite(file: &File, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let longer = file.metadata()?.len() > bytes.len() as u64;
    file.write_all_at(bytes, 0)?;
    match longer {
        true => file.set_len(bytes.len() as u64),
        false => Ok(()),
    }
}

/// Reads at most `cap` bytes of a file; more is `FileTooLarge`.
pub fn read_capped(file: File, cap: u64) -> io::Result<Vec<u8>> {
    let len = file.metadata()?.len();
    if len > cap {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("{len} bytes, over the {cap}-byte limit"),
        ));
    }
    // One byte more than the cap, to see a file that grew meanwhile.
    let mut bytes = Vec::with_capacity(len as usize + 1);
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("over the {cap}-byte limit"),
        ));
    }
    Ok(bytes)
}

/// Whether `file` is open anywhere else, in any process (this one's other descriptors included),
/// as the kernel tells it: a write lease (`F_SETLEASE`) is granted only on a file open nowhere
/// else. The lease is let go at once. `None` where no lease is to be had (a filesystem without
/// them, leases disabled, a file of another user).
///
/// An open of the file in the moment the lease is held waits for it to be let go, and its break
/// is signalled with `SIGURG`, whose default is to be ignored, rather than `SIGIO`, whose default
/// would end the process.
pub fn open_elsewhere(file: &File) -> Option<bool> {
    lease_refused(file, libc::F_WRLCK)
}

/// Whether `file` (opened read-only) is open for writing anywhere, in any process, as the kernel
/// tells it: a read lease is granted only on a file nobody has open for writing. A writer that
/// opened it and has not written yet, however long it is descheduled, is seen; readers are not.
/// `None` as for [`open_elsewhere`].
pub fn open_for_writing(file: &File) -> Option<bool> {
    lease_refused(file, libc::F_RDLCK)
}

/// Whether a lease of `kind` on `file` is refused because of another open of it (`EAGAIN`).
#[allow(unsafe_code)]
fn lease_refused(file: &File, kind: libc::c_int) -> Option<bool> {
    use std::os::fd::AsRawFd as _;
    let fd = file.as_raw_fd();
    // SAFETY: `fcntl` with integer arguments on a descriptor `file` owns for the whole call: no
    // memory is passed, nothing is borrowed past the call.
    let fcntl = |cmd, arg: libc::c_int| unsafe { libc::fcntl(fd, cmd, arg) };
    // `F_SETSIG` (asm-generic/fcntl.h), which the libc crate leaves out on glibc.
    const F_SETSIG: libc::c_int = 10;
    if fcntl(F_SETSIG, libc::SIGURG) == -1 {
        return None;
    }
    if fcntl(libc::F_SETLEASE, kind) == 0 {
        fcntl(libc::F_SETLEASE, libc::F_UNLCK);
        return Some(false);
    }
    match Errno::last() {
        Errno::EAGAIN => Some(true),
        _ => None,
    }
}

/// The most a config or action file may hold.
pub const USER_FILE_CAP: u64 = 1 << 20;

/// Reads a text file the user named by path (a config or action file): not a FIFO or a device,
/// at most [`USER_FILE_CAP`] bytes, valid UTF-8.
pub fn read_text(path: &Path) -> io::Result<String> {
    let bytes = read_user_file(path, USER_FILE_CAP)?;
    String::from_utf8(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not UTF-8 text", path.display()),
        )
    })
}

/// Reads a file the user named by path: not through a FIFO or a device, at most `cap` bytes.
pub fn read_user_file(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(OFlag::O_NONBLOCK.bits())
        .open(path)?;
    let stat = nix::sys::stat::fstat(&file).map_err(io::Error::from)?;
    let kind = SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits());
    if kind != SFlag::S_IFREG {
        return Err(refused(
            path,
            describe(&stat).unwrap_or("is not a regular file"),
        ));
    }
    read_capped(file, cap).map_err(|e| with_path(path, e))
}

/// `path` with every symbolic link on its way resolved, as the kernel names it: what
/// [`std::fs::canonicalize`] gives, in two or three system calls however deep the path rather
/// than one per component. A plain absolute path (no `.`, `..` or doubled `/`) that meets no
/// symbolic link on its way is its own: one lookup that refuses links says so. Any other is
/// opened `O_PATH` (which opens nothing) and its name read back from `/proc/self/fd`; without
/// `/proc`, `canonicalize` itself.
pub fn real_path(path: impl AsRef<Path>) -> io::Result<PathBuf> {
    use nix::fcntl::{OpenHow, ResolveFlag};
    use std::os::fd::AsRawFd as _;
    use std::os::unix::ffi::OsStrExt as _;
    let path = path.as_ref();
    if is_plain_absolute(path) {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS);
        match nix::fcntl::openat2(nix::fcntl::AT_FDCWD, path, how) {
            Ok(_) => return Ok(path.to_owned()),
            // Missing, or not a directory, before any link: so it is for `canonicalize` too.
            Err(e @ (Errno::ENOENT | Errno::ENOTDIR)) => return Err(e.into()),
            // A link on the way (`ELOOP`), or no `openat2` here.
            Err(_) => {}
        }
    }
    let fd = nix::fcntl::open(path, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())?;
    match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        // A name the kernel marks as removed since is asked again the slow way.
        Ok(real) if real.is_absolute() && !real.as_os_str().as_bytes().ends_with(b" (deleted)") => {
            Ok(real)
        }
        _ => std::fs::canonicalize(path),
    }
}

/// Whether `path` is absolute and written as its own real path would be: no `.` or `..`
/// component, no doubled or trailing `/`.
fn is_plain_absolute(path: &Path) -> bool {
    use std::path::Component;
    path.is_absolute()
        && path.components().all(|c| c != Component::ParentDir)
        && path.components().collect::<PathBuf>().as_os_str() == path.as_os_str()
}

fn with_path(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// The pid of the process that made the temporary file `name` ([`Dir::temp_file`]), when its
/// name says.
pub fn temp_writer(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(TEMP_SUFFIX)?;
    let (_, last) = stem.rsplit_once('.')?;
    let (pid, _) = last.split_once('-')?;
    pid.parse().ok()
}

fn random_suffix() -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(6)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Overwritten, a file holds exactly the new bytes, whether they are shorter than what it
    /// held (cut), as long, or longer.
    #[test]
    fn an_overwritten_file_holds_exactly_the_new_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        for (before, after) in [
            ("a longer version", "short"),
            ("same", "SAME"),
            ("short", "a longer version"),
            ("x", ""),
        ] {
            std::fs::write(&path, before).unwrap();
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            overwrite(&file, after.as_bytes()).unwrap();
            drop(file);
            assert_eq!(
                std::fs::read_to_string(&path).unwrap(),
                after,
                "over {before:?}"
            );
        }
    }

    #[test]
    fn a_real_path_is_what_canonicalize_gives() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/file"), "x").unwrap();
        std::os::unix::fs::symlink(root.join("a"), root.join("link")).unwrap();
        std::os::unix::fs::symlink("link/b", root.join("rel")).unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        for path in [
            "a/b/file",
            "a//b/file",
            "a/b/",
            "a/./b",
            "a/b/..",
            "link/b/file",
            "rel/file",
            "rel/../b/./file",
            "link",
            "fifo",
        ] {
            let path = root.join(path);
            assert_eq!(
                real_path(&path).unwrap(),
                std::fs::canonicalize(&path).unwrap(),
                "{}",
                path.display()
            );
        }
        for missing in [
            "nothing",
            "link/nothing",
            "a/b/file/under",
            "link/b/file/under",
            "nothing/..",
        ] {
            let path = root.join(missing);
            assert_eq!(
                real_path(&path).unwrap_err().kind(),
                std::fs::canonicalize(&path).unwrap_err().kind(),
                "{missing}"
            );
        }
    }

    #[test]
    fn a_temporary_file_names_its_writer() {
        let dir = tempfile::tempdir().unwrap();
        let d = Dir::open(dir.path()).unwrap();
        let (name, _) = d.temp_file("x.json").unwrap();
        assert_eq!(temp_writer(&name), Some(std::process::id()), "{name}");
        assert_eq!(temp_writer(".x.json.AbC12z.tmp"), None, "an older loopd's");
        assert_eq!(temp_writer(".x.json.spare.tmp"), None);
        assert_eq!(temp_writer("x.json"), None);
    }

    #[test]
    fn replacing_reuses_the_replaced_version_and_never_follows_a_link() {
        use std::os::unix::fs::MetadataExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let ino = |name: &str| std::fs::metadata(tmp.path().join(name)).unwrap().ino();
        dir.replace_reusing("notes.md", b"one").unwrap();
        let first = ino("notes.md");
        dir.replace_reusing("notes.md", b"two").unwrap();
        let second = ino("notes.md");
        assert_eq!(
            ino(".notes.md.spare.tmp"),
            first,
            "the replaced version is kept"
        );
        dir.replace_reusing("notes.md", b"three").unwrap();
        assert_eq!(ino("notes.md"), first, "and written into next");
        assert_eq!(ino(".notes.md.spare.tmp"), second);
        assert_eq!(
            std::fs::read(tmp.path().join("notes.md")).unwrap(),
            b"three"
        );
        // A spare made a link elsewhere is refused, and what it points to is untouched.
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("profile");
        std::fs::write(&target, "mine\n").unwrap();
        std::fs::remove_file(tmp.path().join(".notes.md.spare.tmp")).unwrap();
        std::os::unix::fs::symlink(&target, tmp.path().join(".notes.md.spare.tmp")).unwrap();
        assert!(is_refusal(
            &dir.replace_reusing("notes.md", b"four").unwrap_err()
        ));
        assert!(is_refusal(
            &dir.open_existing_rw(".notes.md.spare.tmp").unwrap_err()
        ));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "mine\n");
        assert_eq!(
            std::fs::read(tmp.path().join("notes.md")).unwrap(),
            b"three"
        );
    }

    #[test]
    fn symlinks_fifos_and_hard_links_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let target = outside.path().join("profile");
        std::fs::write(&target, "mine\n").unwrap();
        std::os::unix::fs::symlink(&target, tmp.path().join("link")).unwrap();
        std::fs::hard_link(&target, tmp.path().join("hard")).unwrap();
        nix::unistd::mkfifo(&tmp.path().join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("sub")).unwrap();
        for name in ["link", "hard", "fifo"] {
            let e = dir.append(name).unwrap_err();
            assert!(is_refusal(&e), "{name}: {e}");
            let e = dir.create(name).unwrap_err();
            assert!(is_refusal(&e), "{name}: {e}");
            let e = dir.read(name, 100).unwrap_err();
            assert!(is_refusal(&e), "{name}: {e}");
        }
        assert!(is_refusal(&dir.subdir("sub", true).unwrap_err()));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "mine\n");
        // What loopd creates is private.
        let sub = dir.subdir("new", true).unwrap();
        sub.append("f").unwrap().write_all(b"x").unwrap();
        sub.write_atomic("g", b"y", true).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&tmp.path().join("new")), 0o700);
        assert_eq!(mode(&tmp.path().join("new/f")), 0o600);
        assert_eq!(mode(&tmp.path().join("new/g")), 0o600);
        assert_eq!(sub.read("g", 10).unwrap(), b"y");
        let e = sub.read("g", 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::FileTooLarge);
        sub.create("g").unwrap().write_all(b"z").unwrap();
        assert_eq!(sub.read("g", 10).unwrap(), b"z", "emptied, then written");
    }

    #[test]
    fn a_file_open_elsewhere_is_told_and_an_open_meanwhile_ends_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        dir.write_atomic("f", b"x", false).unwrap();
        let elsewhere = || open_elsewhere(&dir.open_read("f").unwrap());
        assert_eq!(elsewhere(), Some(false));
        // Held by another process, then let go.
        let mut holder = std::process::Command::new("sh")
            .args(["-c", "exec 3>>f; read -r _"])
            .current_dir(tmp.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while elsewhere() != Some(true) {
            assert!(
                std::time::Instant::now() < deadline,
                "the holder never opened it"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(holder.stdin.take());
        holder.wait().unwrap();
        assert_eq!(elsewhere(), Some(false));
        // Opens while leases are taken: one that comes while a lease is held breaks it, which is
        // signalled; the signal must not end this process.
        let path = tmp.path().join("f");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let opener = std::thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    drop(File::open(&path).unwrap());
                }
            }
        });
        let file = dir.open_read("f").unwrap();
        for _ in 0..20_000 {
            assert!(open_elsewhere(&file).is_some());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        opener.join().unwrap();
        assert_eq!(open_elsewhere(&file), Some(false));
    }
}
