//! Per-reactor pools of page-aligned I/O buffers.
//!
//! A read goes disk → pool buffer → socket, and a write socket → pool buffer → disk,
//! so every buffer must satisfy `O_DIRECT` alignment. Buffers come in power-of-two
//! size classes from 4 KiB to the largest transfer; a buffer returned to the pool is
//! reused, so after warm-up the I/O path allocates nothing. A buffer's memory never
//! moves while it is alive (it is a heap allocation), which io_uring requires for the
//! duration of an operation.
#![allow(unsafe_code)]

/// One 4 KiB page, aligned so that a vector of pages is `O_DIRECT` aligned.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; PAGE_SIZE]);

/// Size of a page and the alignment of every buffer.
pub const PAGE_SIZE: usize = 4096;

/// An aligned I/O buffer of a power-of-two number of pages.
pub struct Buf {
    pages: Vec<Page>,
    registered: Option<u16>,
}

impl Buf {
    fn new(pages: usize) -> Buf {
        Buf { pages: vec![Page([0; PAGE_SIZE]); pages], registered: None }
    }

    /// The buffer's index in the io_uring registered-buffer table, if it has one.
    pub fn registered_index(&self) -> Option<u16> {
        self.registered
    }

    /// Records that the buffer was registered with io_uring at `index`.
    pub fn set_registered_index(&mut self, index: u16) {
        self.registered = Some(index);
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.pages.len() * PAGE_SIZE
    }

    /// The whole buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `Page` is `repr(C)` around a byte array with no padding, so the
        // vector's elements are `capacity()` contiguous, initialized bytes, borrowed for
        // the lifetime of `&self`.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr().cast::<u8>(), self.capacity()) }
    }

    /// The whole buffer, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.pages.as_mut_ptr().cast::<u8>(), self.capacity()) }
    }

    /// Zeroes `len` bytes at `at` (clamped to the buffer) through the raw pointer, so
    /// no slice of the whole buffer is made while the kernel may be using other parts.
    pub fn zero_range(&mut self, at: usize, len: usize) {
        let end = at.saturating_add(len).min(self.capacity());
        if at < end {
            // SAFETY: [at, end) lies inside the buffer's allocation, and `&mut self`
            // means no Rust reference to it exists; parts the kernel may be using are
            // outside this range by the caller's contract (see `BlockIo::zero`).
            unsafe { std::ptr::write_bytes(self.as_mut_ptr().add(at), 0, end - at) };
        }
    }

    /// Raw pointer for io_uring; valid while the buffer lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pages.as_mut_ptr().cast::<u8>()
    }
}

/// A pool of buffers in size classes of 1, 2, 4, ... pages.
pub struct BufPool {
    classes: Vec<Vec<Buf>>,
    max_bytes: usize,
}

impl BufPool {
    /// A pool serving buffers of up to `max_bytes`.
    pub fn new(max_bytes: usize) -> BufPool {
        let max_pages = max_bytes.div_ceil(PAGE_SIZE).next_power_of_two();
        BufPool { classes: (0..=max_pages.trailing_zeros()).map(|_| Vec::new()).collect(), max_bytes }
    }

    /// A buffer of at least `len` bytes (`len` at most the pool's maximum). Contents
    /// are whatever the previous user left; callers overwrite before exposing them.
    pub fn get(&mut self, len: usize) -> Buf {
        debug_assert!(len <= self.max_bytes);
        let pages = len.max(1).div_ceil(PAGE_SIZE).next_power_of_two();
        let class = pages.trailing_zeros() as usize;
        self.classes[class].pop().unwrap_or_else(|| Buf::new(pages))
    }

    /// Returns a buffer to its class for reuse.
    pub fn put(&mut self, buf: Buf) {
        let class = buf.pages.len().trailing_zeros() as usize;
        if let Some(list) = self.classes.get_mut(class) {
            list.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_reused() {
        let mut pool = BufPool::new(128 * 1024);
        let mut b = pool.get(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.as_mut_ptr() as usize % PAGE_SIZE, 0);
        b.as_mut_slice()[8191] = 7;
        let p = b.as_mut_ptr();
        pool.put(b);
        let mut again = pool.get(8192);
        assert_eq!(again.as_mut_ptr(), p);
        assert_eq!(again.as_slice()[8191], 7);
        again.as_mut_slice()[4096..4100].fill(9);
        again.zero_range(4097, 2);
        assert_eq!(&again.as_slice()[4096..4100], &[9, 0, 0, 9]);
        again.zero_range(8190, 100);
        assert_eq!(again.as_slice()[8191], 0);
        assert_eq!(pool.get(128 * 1024).capacity(), 128 * 1024);
    }
}
