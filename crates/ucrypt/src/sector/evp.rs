//! The only module that calls into AWS-LC. A safe wrapper around one `EVP_CIPHER_CTX`, keyed
//! once; callers reset only the IV per data unit (re-keying expands the key schedule again,
//! many times the cost of an IV reset).
//!
//! Contract: an [`EvpCtx`] is used by one thread at a time (`Send`, not `Sync`); in-place
//! operation (`input == output`) is allowed by AWS-LC for ECB, CBC and XTS.
//!
//! Key hygiene: the key schedule (for XTS both halves; an AES schedule's first round key is
//! the key itself) lives in the context's `cipher_data`, which AWS-LC would put on the
//! ordinary heap. [`EvpCtx::new`] selects the cipher first, without a key, moves the (still
//! keyless) `cipher_data` into a [`SecretBytes`] (locked, `MADV_DONTDUMP`, zeroised on drop)
//! and only then gives AWS-LC the key, so the schedule is written into those pages alone.

use std::os::raw::c_int;
use std::ptr;

use aws_lc_sys as sys;

use crate::secret::{SecretBox, SecretBytes};
use crate::{Error, Result};

/// The most bytes a cipher's per-key context may take here (AES-XTS needs about 520).
const CIPHER_DATA_BYTES_MAX: usize = 4096;

/// The cipher library and its version, as `ucrypt --version` names it: "AWS-LC 5.12.0". The
/// version is that of the AWS-LC linked in (aws-lc-sys builds it from its own source), read
/// from its header at compile time.
pub fn backend() -> String {
    let version = std::ffi::CStr::from_bytes_with_nul(sys::AWSLC_VERSION_NUMBER_STRING)
        .ok()
        .and_then(|v| v.to_str().ok())
        .unwrap_or("(unknown version)");
    format!("AWS-LC {version}")
}

/// The AWS-LC algorithms ucrypt uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alg {
    Aes256Xts,
    AesEcb,
    AesCbc,
    /// AES-CCM with an 11-byte nonce and a 16-byte tag, the shape the kernel's
    /// `rfc4309(ccm(aes))` gives it (see [`EvpCtx::ccm_seal`]).
    AesCcm,
}

pub(crate) struct EvpCtx {
    ctx: *mut sys::EVP_CIPHER_CTX,
    /// The context's `cipher_data` (the key schedule), owned here, not by AWS-LC.
    schedule: Option<SecretBytes>,
}

// SAFETY: an EVP_CIPHER_CTX has no thread affinity; it may move between threads as long as it is
// not used from two at once, which `&mut self` on every use guarantees (the type is not Sync).
unsafe impl Send for EvpCtx {}

fn check(rc: c_int, call: &'static str) -> Result<()> {
    if rc == 1 {
        Ok(())
    } else {
        // SAFETY: clears this thread's AWS-LC error queue; no pointers involved.
        unsafe { sys::ERR_clear_error() };
        Err(Error::CipherLibrary { call })
    }
}

impl EvpCtx {
    /// Keys a context for `alg` in direction `encrypt`. The key schedule is copied into the
    /// context; the caller may wipe `key` afterwards.
    pub(crate) fn new(alg: Alg, key: &[u8], encrypt: bool) -> Result<Self> {
        // SAFETY: the EVP_* getters return pointers to static cipher tables.
        let cipher = unsafe {
            match (alg, key.len()) {
                (Alg::Aes256Xts, 64) => sys::EVP_aes_256_xts(),
                (Alg::AesEcb, 16) => sys::EVP_aes_128_ecb(),
                (Alg::AesEcb, 24) => sys::EVP_aes_192_ecb(),
                (Alg::AesEcb, 32) => sys::EVP_aes_256_ecb(),
                (Alg::AesCbc, 16) => sys::EVP_aes_128_cbc(),
                (Alg::AesCbc, 24) => sys::EVP_aes_192_cbc(),
                (Alg::AesCbc, 32) => sys::EVP_aes_256_cbc(),
                (Alg::AesCcm, 16) => sys::EVP_aes_128_ccm(),
                (Alg::AesCcm, 24) => sys::EVP_aes_192_ccm(),
                (Alg::AesCcm, 32) => sys::EVP_aes_256_ccm(),
                _ => {
                    return Err(Error::Bug(
                        "EvpCtx::new called with a key size the spec rejects",
                    ))
                }
            }
        };
        // SAFETY: allocation call, checked for NULL below.
        let ctx = unsafe { sys::EVP_CIPHER_CTX_new() };
        if ctx.is_null() {
            return Err(Error::CipherLibrary {
                call: "EVP_CIPHER_CTX_new",
            });
        }
        let mut this = EvpCtx {
            ctx,
            schedule: None,
        };
        // The cipher alone first: AWS-LC allocates an unkeyed cipher_data.
        // SAFETY: ctx is valid; NULL key and IV only select the cipher (and reset its state).
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                this.ctx,
                cipher,
                ptr::null_mut(),
                ptr::null(),
                ptr::null(),
                encrypt as c_int,
            )
        };
        check(rc, "EVP_CipherInit_ex(cipher)")?;
        this.adopt_cipher_data(cipher)?;
        if alg == Alg::AesCcm {
            this.ccm_parameters()?;
        }
        let zero_iv = [0u8; 16];
        // SAFETY: ctx is valid and has its cipher; NULL cipher keeps it (and its cipher_data,
        // now ours); key.len() equals the cipher's key length (checked by the match above); the
        // IV buffer is 16 bytes, at least the IV length of every cipher above (ECB ignores it,
        // CCM reads its 11-byte nonce).
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                this.ctx,
                ptr::null(),
                ptr::null_mut(),
                key.as_ptr(),
                zero_iv.as_ptr(),
                -1,
            )
        };
        check(rc, "EVP_CipherInit_ex")?;
        // SAFETY: ctx is initialised. Sectors are whole blocks, so padding must be off.
        let rc = unsafe { sys::EVP_CIPHER_CTX_set_padding(this.ctx, 0) };
        check(rc, "EVP_CIPHER_CTX_set_padding")?;
        Ok(this)
    }

    /// Moves the context's keyless `cipher_data` into `self.schedule` (locked, non-dumpable
    /// pages), so that keying writes the schedule there and nowhere else.
    fn adopt_cipher_data(&mut self, cipher: *const sys::EVP_CIPHER) -> Result<()> {
        let size = cipher_data_bytes(cipher)?;
        // SAFETY: ctx is valid; the bindings give the full layout of EVP_CIPHER_CTX.
        let data = unsafe { (*self.ctx).cipher_data };
        if size == 0 || data.is_null() {
            return Ok(());
        }
        let mut schedule = SecretBytes::zeroed(size);
        // SAFETY: AWS-LC allocated `data` with the cipher's ctx_size, `size` bytes (read from
        // the checked layout); `schedule` holds `size` bytes; the two do not overlap. It holds
        // no key yet (the cipher was selected without one). OPENSSL_free wipes and frees it;
        // the context then points at our buffer, which outlives it (see Drop).
        unsafe {
            ptr::copy_nonoverlapping(data.cast::<u8>(), schedule.as_mut().as_mut_ptr(), size);
            sys::OPENSSL_free(data);
            (*self.ctx).cipher_data = schedule.as_mut().as_mut_ptr().cast();
        }
        self.schedule = Some(schedule);
        Ok(())
    }

    /// Sets a new 16-byte IV (XTS tweak) without re-keying.
    #[inline]
    pub(crate) fn set_iv(&mut self, iv: &[u8; 16]) -> Result<()> {
        // SAFETY: ctx is initialised with a cipher whose IV length is 16 (or ignored, for ECB);
        // NULL cipher and key keep the existing key schedule; -1 keeps the direction.
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                self.ctx,
                ptr::null(),
                ptr::null_mut(),
                ptr::null(),
                iv.as_ptr(),
                -1,
            )
        };
        check(rc, "EVP_CipherInit_ex(iv)")
    }

    /// Transforms `data` in place. `data.len()` must be a multiple of 16 (checked by callers:
    /// sector sizes are) and fit in a C int.
    #[inline]
    pub(crate) fn update_in_place(&mut self, data: &mut [u8]) -> Result<()> {
        debug_assert!(data.len() % 16 == 0 && data.len() <= i32::MAX as usize);
        let mut out_len: c_int = 0;
        // SAFETY: in == out is allowed for these modes; the buffer is valid for data.len() bytes
        // and, with padding off and whole blocks, EVP writes exactly data.len() bytes.
        let rc = unsafe {
            sys::EVP_CipherUpdate(
                self.ctx,
                data.as_mut_ptr(),
                &mut out_len,
                data.as_ptr(),
                data.len() as c_int,
            )
        };
        check(rc, "EVP_CipherUpdate")?;
        if out_len as usize != data.len() {
            return Err(Error::Bug("EVP_CipherUpdate returned a short output"));
        }
        Ok(())
    }

    /// Transforms `src` into `dst` (same length, multiple of 16).
    #[inline]
    pub(crate) fn update(&mut self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        debug_assert!(src.len() == dst.len() && src.len() % 16 == 0);
        let mut out_len: c_int = 0;
        // SAFETY: both buffers are valid for src.len() bytes and do not overlap (distinct
        // borrows); EVP writes exactly src.len() bytes with padding off.
        let rc = unsafe {
            sys::EVP_CipherUpdate(
                self.ctx,
                dst.as_mut_ptr(),
                &mut out_len,
                src.as_ptr(),
                src.len() as c_int,
            )
        };
        check(rc, "EVP_CipherUpdate")?;
        if out_len as usize != src.len() {
            return Err(Error::Bug("EVP_CipherUpdate returned a short output"));
        }
        Ok(())
    }
}

/// AES-CCM's nonce as the kernel's `rfc4309(ccm(aes))` builds it: a 3-byte salt from the key,
/// then the request's 8-byte IV (so L = 15 - 11 = 4 length bytes).
pub(crate) const CCM_NONCE_BYTES: usize = 11;
/// AES-CCM's tag as dm-crypt asks for it (the full 16 bytes).
pub(crate) const CCM_TAG_BYTES: usize = 16;

impl EvpCtx {
    /// AWS-LC's CCM keeps L and M in the per-key context that [`EvpCtx::adopt_cipher_data`]
    /// moved into our pages (its struct sits at an alignment-dependent offset, so the copy is
    /// not trusted): the context is wiped and initialised again in place, then given the
    /// nonce and tag lengths, before the key.
    fn ccm_parameters(&mut self) -> Result<()> {
        if let Some(s) = self.schedule.as_mut() {
            s.as_mut().fill(0);
        }
        let tag_bytes = CCM_TAG_BYTES as c_int;
        for (cmd, arg, call) in [
            (sys::EVP_CTRL_INIT, 0, "EVP_CIPHER_CTX_ctrl(INIT)"),
            (
                sys::EVP_CTRL_AEAD_SET_IVLEN,
                CCM_NONCE_BYTES as c_int,
                "EVP_CIPHER_CTX_ctrl(SET_IVLEN)",
            ),
            (
                sys::EVP_CTRL_AEAD_SET_TAG,
                tag_bytes,
                "EVP_CIPHER_CTX_ctrl(SET_TAG)",
            ),
        ] {
            // SAFETY: ctx has the CCM cipher and its cipher_data (ours, ctx_size bytes); these
            // commands read no pointer (NULL tag: only the tag length is set).
            let rc = unsafe { sys::EVP_CIPHER_CTX_ctrl(self.ctx, cmd, arg, ptr::null_mut()) };
            check(rc, call)?;
        }
        Ok(())
    }

    /// One CCM update call: `len` bytes from `inp` to `out` (either may be NULL, as the CCM
    /// protocol of the EVP interface wants: both NULL sets the message length, a NULL `out`
    /// passes associated data).
    ///
    /// # Safety
    /// Non-NULL `inp` and `out` are valid for `len` bytes (reads, writes) and equal or
    /// disjoint; `len` fits a C int.
    unsafe fn ccm_update(&mut self, out: *mut u8, inp: *const u8, len: usize) -> bool {
        let mut out_len: c_int = 0;
        // SAFETY: the caller's contract; ctx is a keyed CCM context.
        let rc = unsafe { sys::EVP_CipherUpdate(self.ctx, out, &mut out_len, inp, len as c_int) };
        rc == 1 && out_len as usize == len
    }

    /// AES-CCM encryption of one message (a context keyed with [`Alg::AesCcm`] for
    /// encryption): `src` (or `data` itself when `None`) is encrypted into `data`, and the
    /// 16-byte tag over `ad` and the plaintext written to `tag`.
    pub(crate) fn ccm_seal(
        &mut self,
        nonce: &[u8; CCM_NONCE_BYTES],
        ad: &[u8],
        src: Option<&[u8]>,
        data: &mut [u8],
        tag: &mut [u8; CCM_TAG_BYTES],
    ) -> Result<()> {
        let len = data.len();
        if src.is_some_and(|s| s.len() != len) || len > i32::MAX as usize || ad.len() > 4096 {
            return Err(Error::Bug("ccm_seal: buffer sizes"));
        }
        let inp = src.map_or(data.as_ptr(), |s| s.as_ptr());
        self.ccm_nonce(nonce)?;
        // SAFETY: NULL/NULL sets the length; `ad` is valid for its length; `inp` is `src`
        // (a distinct borrow) or `data` itself, both `len` bytes, and `data` is writable.
        let ok = unsafe {
            self.ccm_update(ptr::null_mut(), ptr::null(), len)
                && self.ccm_update(ptr::null_mut(), ad.as_ptr(), ad.len())
                && self.ccm_update(data.as_mut_ptr(), inp, len)
        };
        if !ok {
            // SAFETY: clears this thread's error queue.
            unsafe { sys::ERR_clear_error() };
            return Err(Error::CipherLibrary {
                call: "EVP_CipherUpdate(ccm)",
            });
        }
        // SAFETY: the tag buffer holds CCM_TAG_BYTES, the length asked for.
        let rc = unsafe {
            sys::EVP_CIPHER_CTX_ctrl(
                self.ctx,
                sys::EVP_CTRL_AEAD_GET_TAG,
                CCM_TAG_BYTES as c_int,
                tag.as_mut_ptr().cast(),
            )
        };
        check(rc, "EVP_CIPHER_CTX_ctrl(GET_TAG)")
    }

    /// AES-CCM decryption in place (a context keyed for decryption): true if `tag` verifies
    /// over `ad` and the plaintext; false (with `data` wiped) if it does not.
    pub(crate) fn ccm_open(
        &mut self,
        nonce: &[u8; CCM_NONCE_BYTES],
        ad: &[u8],
        data: &mut [u8],
        tag: &[u8; CCM_TAG_BYTES],
    ) -> Result<bool> {
        let len = data.len();
        if len > i32::MAX as usize || ad.len() > 4096 {
            return Err(Error::Bug("ccm_open: buffer sizes"));
        }
        // SAFETY: the tag is CCM_TAG_BYTES long; AWS-LC copies it (the context decrypts).
        let rc = unsafe {
            sys::EVP_CIPHER_CTX_ctrl(
                self.ctx,
                sys::EVP_CTRL_AEAD_SET_TAG,
                CCM_TAG_BYTES as c_int,
                tag.as_ptr().cast_mut().cast(),
            )
        };
        check(rc, "EVP_CIPHER_CTX_ctrl(SET_TAG)")?;
        self.ccm_nonce(nonce)?;
        let p = data.as_mut_ptr();
        // SAFETY: as in ccm_seal; in place (exact aliasing), `len` bytes.
        let ok = unsafe {
            self.ccm_update(ptr::null_mut(), ptr::null(), len)
                && self.ccm_update(ptr::null_mut(), ad.as_ptr(), ad.len())
                && self.ccm_update(p, p, len)
        };
        if !ok {
            // SAFETY: clears this thread's error queue.
            unsafe { sys::ERR_clear_error() };
            data.fill(0);
        }
        Ok(ok)
    }

    /// Sets the 11-byte CCM nonce for the next message (the key stays).
    fn ccm_nonce(&mut self, nonce: &[u8; CCM_NONCE_BYTES]) -> Result<()> {
        // SAFETY: ctx is a keyed CCM context whose nonce length is CCM_NONCE_BYTES (set in
        // ccm_parameters), the bytes AWS-LC reads from the IV pointer; NULL cipher and key keep
        // the schedule; -1 keeps the direction.
        let rc = unsafe {
            sys::EVP_CipherInit_ex(
                self.ctx,
                ptr::null(),
                ptr::null_mut(),
                ptr::null(),
                nonce.as_ptr(),
                -1,
            )
        };
        check(rc, "EVP_CipherInit_ex(ccm nonce)")
    }
}

impl Drop for EvpCtx {
    fn drop(&mut self) {
        // SAFETY: ctx came from EVP_CIPHER_CTX_new and is freed once. A cipher_data we own is
        // detached first so AWS-LC does not free it (the ciphers used here have no cleanup
        // hook that would touch it); `schedule` wipes it when dropped right after.
        unsafe {
            if self.schedule.is_some() {
                (*self.ctx).cipher_data = ptr::null_mut();
            }
            sys::EVP_CIPHER_CTX_free(self.ctx)
        };
    }
}

/// The AEADs dm-crypt uses with random IVs, each with a 96-bit nonce and a 16-byte tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AeadAlg {
    /// `gcm(aes)`, 128- or 256-bit key.
    AesGcm,
    /// `rfc7539(chacha20,poly1305)` (RFC 8439), 256-bit key.
    ChaCha20Poly1305,
}

/// AES-GCM or ChaCha20-Poly1305 through AWS-LC's `EVP_AEAD` interface with a detached 16-byte
/// tag, for dm-crypt's authenticated sectors. Keyed once; the nonce comes with each call. The context, whose
/// inline state holds the key schedule, lives in a [`SecretBox`] (locked, non-dumpable, wiped)
/// and is initialised there in place (`EVP_AEAD_CTX_init`), so no copy of the key is left on
/// the ordinary heap.
pub(crate) struct AeadCtx {
    ctx: SecretBox<sys::EVP_AEAD_CTX>,
}

// SAFETY: an EVP_AEAD_CTX is immutable after init (seal and open take it by const pointer) and
// has no thread affinity; it is moved, never shared (the type is not Sync).
unsafe impl Send for AeadCtx {}

/// The AEAD tag length as dm-crypt uses it (the full 16 bytes, GCM and Poly1305 alike).
pub(crate) const AEAD_TAG_BYTES: usize = 16;
/// The AEAD nonce length: 96 bits, what dm-crypt's `gcm(aes)` and `rfc7539(chacha20,poly1305)`
/// take as their IV.
pub(crate) const AEAD_NONCE_BYTES: usize = 12;

impl AeadCtx {
    pub(crate) fn new(alg: AeadAlg, key: &[u8]) -> Result<Self> {
        // SAFETY: static algorithm tables.
        let aead = unsafe {
            match (alg, key.len()) {
                (AeadAlg::AesGcm, 16) => sys::EVP_aead_aes_128_gcm(),
                (AeadAlg::AesGcm, 32) => sys::EVP_aead_aes_256_gcm(),
                (AeadAlg::ChaCha20Poly1305, 32) => sys::EVP_aead_chacha20_poly1305(),
                _ => {
                    return Err(Error::Bug(
                        "AeadCtx::new called with a key size the spec rejects",
                    ))
                }
            }
        };
        // SAFETY: all-zero is the state EVP_AEAD_CTX_zero leaves (no algorithm, nothing to
        // free), a valid EVP_AEAD_CTX.
        let mut ctx = unsafe { SecretBox::<sys::EVP_AEAD_CTX>::zeroed() };
        // SAFETY: ctx points at a zeroed context of the bindings' full size in memory we own;
        // key is valid for key.len() bytes, the length the algorithm takes (matched above);
        // AES-GCM and ChaCha20-Poly1305 keep their key state inside the context (no
        // allocation); no engine.
        let rc = unsafe {
            sys::EVP_AEAD_CTX_init(
                ctx.as_mut_ptr(),
                aead,
                key.as_ptr(),
                key.len(),
                AEAD_TAG_BYTES,
                ptr::null_mut(),
            )
        };
        let ctx = AeadCtx { ctx };
        check(rc, "EVP_AEAD_CTX_init")?;
        Ok(ctx)
    }

    /// Encrypts `data` in place and writes its tag.
    pub(crate) fn seal_in_place(
        &mut self,
        nonce: &[u8; AEAD_NONCE_BYTES],
        ad: &[u8],
        data: &mut [u8],
        tag: &mut [u8; AEAD_TAG_BYTES],
    ) -> Result<()> {
        let p = data.as_mut_ptr();
        // SAFETY: in == out (exact aliasing, which AWS-LC allows), both `data.len()` bytes.
        unsafe { self.seal_raw(nonce, ad, p, p, data.len(), tag) }
    }

    /// Encrypts `src` into `dst` (same length, distinct buffers) and writes the tag: a
    /// plaintext that must stay as it is (a caller's write buffer) is read once, not copied
    /// first.
    pub(crate) fn seal_to(
        &mut self,
        nonce: &[u8; AEAD_NONCE_BYTES],
        ad: &[u8],
        src: &[u8],
        dst: &mut [u8],
        tag: &mut [u8; AEAD_TAG_BYTES],
    ) -> Result<()> {
        assert_eq!(src.len(), dst.len(), "seal_to: lengths");
        // SAFETY: two distinct borrows (they cannot overlap), each `src.len()` bytes.
        unsafe { self.seal_raw(nonce, ad, src.as_ptr(), dst.as_mut_ptr(), src.len(), tag) }
    }

    /// # Safety
    /// `src` and `dst` are valid for `len` bytes (reads, writes) and either equal or disjoint.
    unsafe fn seal_raw(
        &mut self,
        nonce: &[u8; AEAD_NONCE_BYTES],
        ad: &[u8],
        src: *const u8,
        dst: *mut u8,
        len: usize,
        tag: &mut [u8; AEAD_TAG_BYTES],
    ) -> Result<()> {
        let mut tag_len = 0usize;
        // SAFETY: the caller's contract (AWS-LC allows in == out when the two alias exactly);
        // nonce and ad are valid for their lengths; the tag buffer holds max_out_tag_len bytes.
        let rc = unsafe {
            sys::EVP_AEAD_CTX_seal_scatter(
                self.ctx.as_ptr(),
                dst,
                tag.as_mut_ptr(),
                &mut tag_len,
                AEAD_TAG_BYTES,
                nonce.as_ptr(),
                nonce.len(),
                src,
                len,
                ptr::null(),
                0,
                ad.as_ptr(),
                ad.len(),
            )
        };
        check(rc, "EVP_AEAD_CTX_seal_scatter")?;
        if tag_len != AEAD_TAG_BYTES {
            return Err(Error::Bug("EVP_AEAD_CTX_seal_scatter returned a short tag"));
        }
        Ok(())
    }

    /// Decrypts `data` in place if `tag` verifies; returns false (and wipes `data`, which may
    /// hold unauthenticated plaintext) if it does not.
    pub(crate) fn open_in_place(
        &mut self,
        nonce: &[u8; AEAD_NONCE_BYTES],
        ad: &[u8],
        data: &mut [u8],
        tag: &[u8; AEAD_TAG_BYTES],
    ) -> bool {
        // SAFETY: as for seal: exact aliasing of in and out is allowed; lengths match buffers.
        let rc = unsafe {
            sys::EVP_AEAD_CTX_open_gather(
                self.ctx.as_ptr(),
                data.as_mut_ptr(),
                nonce.as_ptr(),
                nonce.len(),
                data.as_ptr(),
                data.len(),
                tag.as_ptr(),
                tag.len(),
                ad.as_ptr(),
                ad.len(),
            )
        };
        if rc == 1 {
            return true;
        }
        // SAFETY: clears this thread's error queue.
        unsafe { sys::ERR_clear_error() };
        data.fill(0);
        false
    }
}

impl Drop for AeadCtx {
    fn drop(&mut self) {
        // SAFETY: the context was zeroed and then initialised (or left zeroed by a failed
        // init, which cleanup accepts) and is cleaned up once, here; the SecretBox wipes and
        // frees its memory afterwards.
        unsafe { sys::EVP_AEAD_CTX_cleanup(self.ctx.as_mut_ptr()) };
    }
}

/// The size of `cipher`'s per-key context. AWS-LC keeps it in the private `EVP_CIPHER`
/// struct, whose first fields are `int nid; unsigned block_size, key_len, iv_len, ctx_size`:
/// the first four are checked against the public getters before the fifth is trusted.
fn cipher_data_bytes(cipher: *const sys::EVP_CIPHER) -> Result<usize> {
    let bad = Error::Bug("AWS-LC's EVP_CIPHER layout is not the one expected");
    // SAFETY: cipher points at a static EVP_CIPHER table (from an EVP_aes_* getter), at least
    // five 4-byte fields long (see above); the getters take that pointer.
    let (fields, nid, block, key, iv) = unsafe {
        let f = cipher.cast::<u32>();
        (
            [
                f.read(),
                f.add(1).read(),
                f.add(2).read(),
                f.add(3).read(),
                f.add(4).read(),
            ],
            sys::EVP_CIPHER_nid(cipher) as u32,
            sys::EVP_CIPHER_block_size(cipher),
            sys::EVP_CIPHER_key_length(cipher),
            sys::EVP_CIPHER_iv_length(cipher),
        )
    };
    if fields[..4] != [nid, block, key, iv] {
        return Err(bad);
    }
    let size = fields[4] as usize;
    if size > CIPHER_DATA_BYTES_MAX {
        return Err(bad);
    }
    Ok(size)
}
