//! Filesystem sizes of a mounted path (statvfs(3)), for NodeGetVolumeStats.
#![allow(unsafe_code)]

use std::ffi::CString;

pub struct FsInfo {
    pub bytes_total: u64,
    pub bytes_free: u64,
    pub bytes_available: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
}

pub fn statvfs(path: &str) -> std::io::Result<FsInfo> {
    let c_path = CString::new(path).map_err(|_| std::io::Error::other("path contains a NUL byte"))?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: c_path is a valid NUL-terminated string and s points to writable memory
    // of the right size; statvfs fills it completely when it returns 0.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), s.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised the struct.
    let s = unsafe { s.assume_init() };
    let fragment = s.f_frsize;
    Ok(FsInfo {
        bytes_total: s.f_blocks * fragment,
        bytes_free: s.f_bfree * fragment,
        bytes_available: s.f_bavail * fragment,
        inodes_total: s.f_files,
        inodes_free: s.f_ffree,
    })
}
