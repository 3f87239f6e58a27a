//! Little-endian field access on byte slices.
//!
//! The structures in this crate are fixed layouts with byte offsets taken from the
//! specifications. These helpers keep the offset arithmetic in one place. Callers pass
//! offsets that lie inside buffers whose size is fixed by the layout, so the slice
//! indexing below never fails for a correctly sized buffer.

/// Reads a little-endian `u16` at `off`.
pub fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Reads a little-endian `u32` at `off`.
pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Reads a little-endian `u64` at `off`.
pub fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(v)
}

/// Writes a little-endian `u16` at `off`.
#[inline]
pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

/// Writes a little-endian `u32` at `off`.
#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Writes a little-endian `u64` at `off`.
#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Moves the unparsed bytes `buf[*start..*end]` of a receive buffer to its front, so
/// the next read has the most room and a partial PDU stays contiguous.
pub fn compact(buf: &mut [u8], start: &mut usize, end: &mut usize) {
    buf.copy_within(*start..*end, 0);
    *end -= *start;
    *start = 0;
}

/// Copies a fixed-size array out of `b` at `off`.
pub fn get_array<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    let mut v = [0u8; N];
    v.copy_from_slice(&b[off..off + N]);
    v
}

/// Reads a space-padded ASCII field, trimming the padding.
pub fn get_ascii_padded(b: &[u8], off: usize, len: usize) -> String {
    String::from_utf8_lossy(&b[off..off + len]).trim_end_matches([' ', '\0']).to_string()
}

/// Writes `s` into a NUL-padded string field (NQNs, transport addresses).
pub fn put_nul_padded(b: &mut [u8], off: usize, len: usize, s: &str) {
    let field = &mut b[off..off + len];
    field.fill(0);
    // Keep room for the terminating NUL, as NQN fields are NUL-terminated strings.
    let n = s.len().min(len - 1);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Reads a NUL-terminated string field (NQNs, transport addresses).
pub fn get_nul_padded(b: &[u8], off: usize, len: usize) -> String {
    let field = &b[off..off + len];
    let end = field.iter().position(|&c| c == 0).unwrap_or(len);
    String::from_utf8_lossy(&field[..end]).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_keeps_the_unparsed_bytes() {
        let mut b = *b"xxabcde";
        let (mut start, mut end) = (2, 5);
        compact(&mut b, &mut start, &mut end);
        assert_eq!((start, end, &b[..3]), (0, 3, &b"abc"[..]));
    }

    #[test]
    fn strings_round_trip_and_truncate() {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&ascii::<8>("abc"));
        assert_eq!(&b[..8], b"abc     ");
        assert_eq!(get_ascii_padded(&b, 0, 8), "abc");
        put_nul_padded(&mut b, 8, 8, "0123456789");
        assert_eq!(get_nul_padded(&b, 8, 8), "0123456");
    }
}

/// A fixed-width little-endian field of a wire layout.
pub trait Field: Sized {
    /// Width in bytes.
    const WIDTH: usize;
    /// Reads the field at `off`.
    fn get(b: &[u8], off: usize) -> Self;
    /// Writes the field at `off`.
    fn put(&self, b: &mut [u8], off: usize);
}

macro_rules! int_field {
    ($t:ty, $get:ident, $put:ident) => {
        impl Field for $t {
            const WIDTH: usize = size_of::<$t>();
            fn get(b: &[u8], off: usize) -> Self {
                $get(b, off)
            }
            fn put(&self, b: &mut [u8], off: usize) {
                $put(b, off, *self)
            }
        }
    };
}
int_field!(u16, get_u16, put_u16);
int_field!(u32, get_u32, put_u32);
int_field!(u64, get_u64, put_u64);

impl Field for u8 {
    const WIDTH: usize = 1;
    fn get(b: &[u8], off: usize) -> Self {
        b[off]
    }
    fn put(&self, b: &mut [u8], off: usize) {
        b[off] = *self
    }
}

impl<const N: usize> Field for [u8; N] {
    const WIDTH: usize = N;
    fn get(b: &[u8], off: usize) -> Self {
        get_array(b, off)
    }
    fn put(&self, b: &mut [u8], off: usize) {
        b[off..off + N].copy_from_slice(self)
    }
}

/// A space-padded ASCII array, as Identify strings are stored.
pub fn ascii<const N: usize>(s: &str) -> [u8; N] {
    let mut v = [b' '; N];
    let n = s.len().min(N);
    v[..n].copy_from_slice(&s.as_bytes()[..n]);
    v
}

/// A NUL-padded string array, as NQNs are stored.
pub fn nul<const N: usize>(s: &str) -> [u8; N] {
    let mut v = [0u8; N];
    put_nul_padded(&mut v, 0, N, s);
    v
}

/// Declares a fixed wire layout: a struct of named fields at byte offsets, with
/// `SIZE`, `decode` and `encode`. Unlisted bytes are reserved and encode as zero. Every
/// field is checked at compile time to lie inside the layout.
macro_rules! layout {
    (
        $(#[$meta:meta])*
        pub struct $name:ident [$size:expr] {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty = $off:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl $name {
            /// Size of the encoded structure in bytes.
            pub const SIZE: usize = $size;

            /// Decodes from the first `SIZE` bytes of `b`. Returns `None` if `b` is
            /// shorter.
            pub fn decode(b: &[u8]) -> Option<Self> {
                if b.len() < Self::SIZE {
                    return None;
                }
                Some(Self { $( $field: <$ty as $crate::bytes::Field>::get(b, $off), )* })
            }

            /// Encodes into the first `SIZE` bytes of `b`, zeroing reserved bytes.
            /// `b` must be at least `SIZE` bytes long.
            pub fn encode(&self, b: &mut [u8]) {
                b[..Self::SIZE].fill(0);
                $( $crate::bytes::Field::put(&self.$field, b, $off); )*
            }

            /// Encodes into a new vector of `SIZE` bytes.
            pub fn to_vec(&self) -> Vec<u8> {
                let mut v = vec![0u8; Self::SIZE];
                self.encode(&mut v);
                v
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $( $field: <$ty as $crate::bytes::Field>::get(&[0u8; $size], 0), )* }
            }
        }

        // Offsets of zero make clippy see `0 + w <= n`; the general form is clearer.
        $( #[allow(clippy::int_plus_one)] const _: () = assert!($off + <$ty as $crate::bytes::Field>::WIDTH <= $size); )*
    };
}
pub(crate) use layout;
