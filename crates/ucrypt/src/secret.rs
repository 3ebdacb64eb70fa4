//! Secrets as types: key material and passphrases live in [`SecretBytes`], a heap buffer that is
//! locked in RAM (`mlock`, best effort), excluded from core dumps (`MADV_DONTDUMP`), never
//! `Debug`-printed, not `Clone`, compared in constant time and zeroised on drop.
//!
//! The buffer is allocated page-aligned so that the `madvise`/`mlock` calls cover exactly the
//! pages that hold the secret and no unrelated heap data.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use subtle::ConstantTimeEq;
use zeroize::Zeroize;

// mlock/madvise round to pages anyway.
use crate::sync::PAGE_BYTES;

/// Largest secret we ever hold: a LUKS anti-forensic split of a 512-byte key is 4000 × 64 bytes
/// = 256 KiB; leave headroom for keyfiles (cryptsetup caps keyfiles at 8 MiB).
pub const SECRET_BYTES_MAX: usize = 8 << 20;

/// A fixed-length secret byte buffer. See the module documentation.
pub struct SecretBytes {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: SecretBytes owns its allocation exclusively (like a Box<[u8]>); no interior mutability.
unsafe impl Send for SecretBytes {}
// SAFETY: shared references only allow reads of the owned buffer.
unsafe impl Sync for SecretBytes {}

impl SecretBytes {
    /// A zero-filled secret of `len` bytes. Panics only if `len > SECRET_BYTES_MAX` (caller bug:
    /// every caller bounds its input first) or the allocator fails.
    pub fn zeroed(len: usize) -> Self {
        assert!(
            len <= SECRET_BYTES_MAX,
            "secret of {len} bytes exceeds SECRET_BYTES_MAX"
        );
        let cap = len.max(1).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let layout = Layout::from_size_align(cap, PAGE_BYTES).expect("page layout is valid");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: ptr..ptr+cap is our own, page-aligned allocation. Both calls are advisory: a
        // failure (RLIMIT_MEMLOCK reached, kernel without MADV_DONTDUMP) leaves a working buffer.
        unsafe {
            libc::madvise(raw.cast(), cap, libc::MADV_DONTDUMP);
            libc::mlock(raw.cast(), cap);
        }
        SecretBytes { ptr, len, cap }
    }

    /// Copies `bytes` into a new secret. The caller remains responsible for wiping the source.
    pub fn from_slice(bytes: &[u8]) -> Self {
        let mut s = Self::zeroed(bytes.len());
        s.as_mut().copy_from_slice(bytes);
        s
    }

    /// Moves a vector into a secret and wipes the vector's buffer.
    pub fn from_vec(mut v: Vec<u8>) -> Self {
        let s = Self::from_slice(&v);
        v.zeroize();
        s
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Constant-time equality (length is not secret).
    pub fn ct_eq(&self, other: &[u8]) -> bool {
        self.len == other.len() && bool::from(self.as_ref().ct_eq(other))
    }

    /// A new secret holding `self[range]`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        Self::from_slice(&self.as_ref()[range])
    }
}

impl AsRef<[u8]> for SecretBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised (zeroed) bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for SecretBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SecretBytes {
    fn drop(&mut self) {
        // SAFETY: ptr..ptr+cap is our allocation; zeroize's volatile writes are not elided.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap).zeroize();
            libc::munlock(self.ptr.as_ptr().cast(), self.cap);
            let layout =
                Layout::from_size_align(self.cap, PAGE_BYTES).expect("page layout is valid");
            dealloc(self.ptr.as_ptr(), layout);
        }
    }
}

impl std::fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretBytes({} bytes, redacted)", self.len)
    }
}

/// Asks the kernel not to write this process's memory to core dumps at all (`PR_SET_DUMPABLE`
/// = 0). The CLI calls it at start-up when it will handle passphrases or keys.
pub fn disable_core_dumps() {
    // SAFETY: prctl with PR_SET_DUMPABLE takes an integer argument and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_contents() {
        let s = SecretBytes::from_slice(b"hunter2");
        let d = format!("{s:?}");
        assert!(!d.contains("hunter2"));
        assert!(d.contains("7 bytes"));
    }

    #[test]
    fn ct_eq_matches_plain_equality() {
        let s = SecretBytes::from_slice(&[1, 2, 3]);
        assert!(s.ct_eq(&[1, 2, 3]));
        assert!(!s.ct_eq(&[1, 2, 4]));
        assert!(!s.ct_eq(&[1, 2]));
    }

    #[test]
    fn empty_secret_is_valid() {
        let s = SecretBytes::zeroed(0);
        assert!(s.is_empty());
        assert_eq!(s.as_ref(), &[] as &[u8]);
    }
}
