//! nvCOMP 6, opened at run time (`dlopen`), as libcuda is: the wheel neither contains nor links it, so it imports
//! and works unchanged where nvCOMP is missing (then no backup is compressed).
//!
//! Only the entry points the CUDA codec (`cuda_codec.rs`) uses are declared: the batched ANS codec (maximum
//! output chunk size, alignments, temporary sizes, compress and decompress) and `nvcompGetProperties` to check the
//! major version, with the option structs of the 6.x headers (`include/nvcomp/ans.h`, `shared_types.h`). ANS
//! bitstreams are not compatible across major versions, so any other major is refused.
//!
//! Where the library comes from, first that applies: `CUMEM_RS_NVCOMP_LIB` (a path; only it is tried), else a
//! path the Python package handed over (`set_wheel_candidates`: the installed `nvidia-libnvcomp-cu13`/`-cu12`
//! wheel whose CUDA major fits the running driver), else `libnvcomp.so.6` through the system loader. The outcome
//! is decided once per process and logged in one line.

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use parking_lot::Mutex;

/// The soname the system loader is asked for when no path is known.
const SONAME: &str = "libnvcomp.so.6";
/// The only major version whose ANS format and option structs this module knows.
pub const MAJOR: u32 = 6;

/// `nvcompStatus_t`: 0 is success.
pub type Status = i32;
pub const SUCCESS: Status = 0;

/// `nvcompType_t` codes the codec uses.
pub const TYPE_CHAR: i32 = 0;
pub const TYPE_FLOAT8_E4M3: i32 = 9;
pub const TYPE_FLOAT16: i32 = 10;

/// `nvcompBatchedANSCompressOpts_t` (64 bytes): rANS, the data type, the rest at its defaults (zero).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CompressOpts {
    /// `nvcompANSType_t`: 0 = rANS, the only one.
    pub ans_type: i32,
    pub data_type: i32,
    pub max_sub_chunk_count: u8,
    pub states_per_lane: u8,
    pub histogram_reduction_log2: u8,
    pub reserved: [u8; 53],
}

/// `nvcompBatchedANSDecompressOpts_t` (64 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DecompressOpts {
    /// `nvcompDecompressBackend_t`: 0 = let nvCOMP choose.
    pub backend: i32,
    pub data_type: i32,
    pub max_sub_chunk_count: u8,
    pub states_per_lane: u8,
    pub skip_validate: u8,
    pub reserved: [u8; 53],
}

// The headers make both structs 64 bytes (53 reserved bytes "ensure compatibility"); passed by value, a wrong size
// would shift every later argument.
const _: () = assert!(std::mem::size_of::<CompressOpts>() == 64);
const _: () = assert!(std::mem::size_of::<DecompressOpts>() == 64);

impl CompressOpts {
    pub fn new(data_type: i32) -> Self {
        CompressOpts {
            ans_type: 0,
            data_type,
            max_sub_chunk_count: 0,
            states_per_lane: 0,
            histogram_reduction_log2: 0,
            reserved: [0; 53],
        }
    }
}

impl DecompressOpts {
    /// Per-chunk validation stays on: a corrupted blob must come back as a failed status, not as bytes.
    pub fn new(data_type: i32) -> Self {
        DecompressOpts {
            backend: 0,
            data_type,
            max_sub_chunk_count: 0,
            states_per_lane: 0,
            skip_validate: 0,
            reserved: [0; 53],
        }
    }
}

/// `nvcompProperties_t`. `version` is major * 1000 + minor * 100 + patch (`MAKE_SEMANTIC_VERSION`).
#[repr(C)]
#[derive(Default)]
struct Properties {
    version: u32,
    cudart_version: u32,
}

/// `nvcompAlignmentRequirements_t`.
#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
pub struct Alignments {
    pub input: usize,
    pub output: usize,
    pub temp: usize,
}

type GetProperties = unsafe extern "C" fn(*mut Properties) -> Status;
type GetStatusString = unsafe extern "C" fn(Status) -> *const c_char;
type CompressAlignments = unsafe extern "C" fn(CompressOpts, *mut Alignments) -> Status;
type DecompressAlignments = unsafe extern "C" fn(DecompressOpts, *mut Alignments) -> Status;
type MaxOutputChunkSize = unsafe extern "C" fn(usize, CompressOpts, *mut usize) -> Status;
type CompressTempSize =
    unsafe extern "C" fn(usize, usize, CompressOpts, *mut usize, usize, CUstream) -> Status;
type DecompressTempSize =
    unsafe extern "C" fn(usize, usize, DecompressOpts, *mut usize, usize, CUstream) -> Status;
/// (uncompressed ptrs, uncompressed bytes, max chunk bytes, chunks, temp, temp bytes, compressed ptrs,
/// compressed bytes (out), opts, statuses (out), stream); every array in device memory.
type CompressAsync = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    usize,
    usize,
    *mut c_void,
    usize,
    *const *mut c_void,
    *mut usize,
    CompressOpts,
    *mut Status,
    CUstream,
) -> Status;
/// (compressed ptrs, compressed bytes, output buffer bytes, actual output bytes (out), chunks, temp, temp bytes,
/// output ptrs, opts, statuses (out), stream); every array in device memory.
type DecompressAsync = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    *const usize,
    *mut usize,
    usize,
    *mut c_void,
    usize,
    *const *mut c_void,
    DecompressOpts,
    *mut Status,
    CUstream,
) -> Status;

/// The loaded library: its entry points, valid as long as `_library` (kept for the life of the process).
pub struct NvComp {
    _library: libloading::Library,
    /// Where it was loaded from, for `describe` and logs.
    pub origin: String,
    /// (major, minor, patch).
    pub version: (u32, u32, u32),
    status_string: Option<GetStatusString>,
    compress_alignments: CompressAlignments,
    decompress_alignments: DecompressAlignments,
    max_output_chunk_size: MaxOutputChunkSize,
    compress_temp_size: CompressTempSize,
    decompress_temp_size: DecompressTempSize,
    compress_async: CompressAsync,
    decompress_async: DecompressAsync,
}

/// Paths handed over by the Python package: (CUDA major of the wheel, path of its libnvcomp.so.6).
static WHEEL_CANDIDATES: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());
/// The outcome of the one load of this process: the library, or why there is none.
static LOADED: OnceLock<Result<NvComp, String>> = OnceLock::new();

/// Remember the installed nvCOMP wheels (CUDA major, library path) for the load. Only heeded before the CUDA
/// driver was loaded (the load happens once, then).
pub fn set_wheel_candidates(candidates: Vec<(u32, PathBuf)>) {
    *WHEEL_CANDIDATES.lock() = candidates;
}

/// The library, loaded on the first call (for a driver of `driver_version`, e.g. 13000), or why there is none.
pub fn load(driver_version: i32) -> Result<&'static NvComp, &'static str> {
    LOADED
        .get_or_init(|| {
            let outcome = find_and_open(driver_version);
            // One line: INFO where nvCOMP is simply not installed, WARNING where one was found and is unusable.
            match outcome {
                Ok(nv) => {
                    let (a, b, c) = nv.version;
                    log::info!(
                        "nvCOMP {a}.{b}.{c} loaded from {}: backups are compressed on the GPU",
                        nv.origin
                    );
                    Ok(nv)
                }
                Err(Missing::NotInstalled(why)) => {
                    log::info!("no GPU compression of backups: {why}");
                    Err(why)
                }
                Err(Missing::Unusable(why)) => {
                    log::warn!("no GPU compression of backups: {why}");
                    Err(why)
                }
            }
        })
        .as_ref()
        .map_err(String::as_str)
}

/// What the load found, without loading: None while the CUDA driver has not tried yet.
pub fn outcome() -> Option<Result<&'static NvComp, &'static str>> {
    LOADED.get().map(|r| r.as_ref().map_err(String::as_str))
}

/// Why there is no library: none to be found (the normal case without the extra), or one that failed.
enum Missing {
    NotInstalled(String),
    Unusable(String),
}

/// A library that could not be opened at all, or one that opened and is not a usable nvCOMP 6.
enum OpenError {
    Load(String),
    Refused(String),
}

impl OpenError {
    fn text(&self) -> &str {
        match self {
            OpenError::Load(s) | OpenError::Refused(s) => s,
        }
    }
}

fn find_and_open(driver_version: i32) -> Result<NvComp, Missing> {
    if let Some(path) = crate::env::process_var_os(crate::env::NVCOMP_LIB).filter(|p| !p.is_empty())
    {
        let path = PathBuf::from(path);
        // An explicit path is the user's choice: no other library replaces it silently.
        return open(&path.to_string_lossy(), "CUMEM_RS_NVCOMP_LIB").map_err(|e| {
            Missing::Unusable(format!(
                "CUMEM_RS_NVCOMP_LIB={}: {}",
                path.display(),
                e.text()
            ))
        });
    }
    let driver_major = u32::try_from(driver_version / 1000).unwrap_or(0);
    let candidates = WHEEL_CANDIDATES.lock().clone();
    let mut refused = Vec::new();
    if let Some((major, path)) = pick_wheel(&candidates, driver_major) {
        let from = format!("the nvidia-libnvcomp-cu{major} wheel");
        match open(&path.to_string_lossy(), &from) {
            Ok(nv) => return Ok(nv),
            Err(e) => refused.push(format!("{}: {}", path.display(), e.text())),
        }
    } else if !candidates.is_empty() {
        let majors: Vec<String> = candidates.iter().map(|(m, _)| format!("cu{m}")).collect();
        refused.push(format!(
            "the installed nvCOMP wheel ({}) needs a newer driver than this one (CUDA {driver_major})",
            majors.join(", ")
        ));
    }
    match open(SONAME, "the system loader") {
        Ok(nv) => Ok(nv),
        Err(OpenError::Load(e)) if refused.is_empty() => Err(Missing::NotInstalled(format!(
            "nvCOMP 6 not found ({e}); install cumem_rs[nvcomp-cu12] or [nvcomp-cu13], or set CUMEM_RS_NVCOMP_LIB"
        ))),
        Err(e) => {
            refused.push(format!("{SONAME}: {}", e.text()));
            Err(Missing::Unusable(refused.join("; ")))
        }
    }
}

/// The wheel to load for a driver of CUDA major `driver_major`: the one of the same major, else the newest older
/// one (CUDA libraries run on newer drivers, never on older ones).
fn pick_wheel(candidates: &[(u32, PathBuf)], driver_major: u32) -> Option<(u32, PathBuf)> {
    let fits = candidates.iter().filter(|(m, _)| *m <= driver_major);
    fits.max_by_key(|(m, _)| *m).cloned()
}

/// Open `name` (a path, or a soname for the system loader), check it is 6.x, look up the entry points.
fn open(name: &str, from: &str) -> Result<NvComp, OpenError> {
    // SAFETY: loading a shared library runs its initialisers; nvCOMP's only set up its own state (it needs
    // nothing but glibc and libstdc++). Libraries named by the user are trusted as the user's choice.
    let library =
        unsafe { libloading::Library::new(name) }.map_err(|e| OpenError::Load(loader_error(&e)))?;
    let refused = OpenError::Refused;
    // SAFETY: the symbol names and types are those of nvCOMP 6's headers (checked below by the version).
    let get_properties: GetProperties =
        unsafe { symbol(&library, b"nvcompGetProperties\0") }.map_err(refused)?;
    let mut props = Properties::default();
    // SAFETY: valid out-pointer to a struct of the header's layout.
    let status = unsafe { get_properties(&mut props) };
    if status != SUCCESS {
        return Err(refused(format!(
            "nvcompGetProperties failed (status {status})"
        )));
    }
    let v = props.version;
    let version = (v / 1000, (v % 1000) / 100, v % 100);
    if version.0 != MAJOR {
        return Err(refused(format!(
            "nvCOMP {}.{}.{} found, version {MAJOR}.x needed (ANS streams and option structs differ across majors)",
            version.0, version.1, version.2
        )));
    }
    // SAFETY (every `symbol` call below): names and signatures as declared in nvCOMP 6's ans.h / nvcomp.h; the
    // version was checked above.
    let nv = (|| unsafe {
        Ok(NvComp {
            status_string: symbol(&library, b"nvcompGetStatusString\0").ok(),
            compress_alignments: symbol(
                &library,
                b"nvcompBatchedANSCompressGetRequiredAlignments\0",
            )?,
            decompress_alignments: symbol(
                &library,
                b"nvcompBatchedANSDecompressGetRequiredAlignments\0",
            )?,
            max_output_chunk_size: symbol(
                &library,
                b"nvcompBatchedANSCompressGetMaxOutputChunkSize\0",
            )?,
            compress_temp_size: symbol(&library, b"nvcompBatchedANSCompressGetTempSize\0")?,
            decompress_temp_size: symbol(&library, b"nvcompBatchedANSDecompressGetTempSize\0")?,
            compress_async: symbol(&library, b"nvcompBatchedANSCompressAsync\0")?,
            decompress_async: symbol(&library, b"nvcompBatchedANSDecompressAsync\0")?,
            origin: format!("{name} (through {from})"),
            version,
            _library: library,
        })
    })()
    .map_err(refused)?;
    Ok(nv)
}

/// libloading's error with the loader's own text ("dlopen failed: libnvcomp.so.6: cannot open shared object").
fn loader_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Look up `name` (NUL-terminated) as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's real function type; the pointer is used only while `library` is loaded.
unsafe fn symbol<T: Copy>(library: &libloading::Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller's contract.
    unsafe { library.get::<T>(name) }.map(|s| *s).map_err(|e| {
        format!(
            "{}: {}",
            String::from_utf8_lossy(&name[..name.len() - 1]),
            loader_error(&e)
        )
    })
}

/// A failed nvCOMP call, as the crate's error: `op` names the call, the status and nvCOMP's text for it.
pub fn failure(nv: &NvComp, op: &'static str, status: Status) -> crate::error::Error {
    crate::error::Error::driver(
        op,
        crate::error::cuda_code::UNKNOWN,
        format!("nvCOMP status {status} ({})", nv.status_name(status)),
    )
}

impl NvComp {
    /// nvCOMP's text for a status, or its number.
    pub fn status_name(&self, status: Status) -> String {
        let text = self.status_string.map(|f| {
            // SAFETY: nvcompGetStatusString returns a pointer to a static NUL-terminated string (or null).
            let p = unsafe { f(status) };
            // SAFETY: non-null: a static C string of the library, which stays loaded.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
        text.flatten().unwrap_or_else(|| format!("status {status}"))
    }

    fn check(&self, op: &'static str, status: Status) -> crate::error::Result<()> {
        if status == SUCCESS {
            Ok(())
        } else {
            Err(failure(self, op, status))
        }
    }

    /// The alignments compression and decompression need of their buffers (the larger of the two, field by field).
    pub fn alignments(&self, data_type: i32) -> crate::error::Result<Alignments> {
        let (mut c, mut d) = (Alignments::default(), Alignments::default());
        // SAFETY: options by value, valid out-pointers.
        unsafe {
            self.check(
                "nvcompBatchedANSCompressGetRequiredAlignments",
                (self.compress_alignments)(CompressOpts::new(data_type), &mut c),
            )?;
            self.check(
                "nvcompBatchedANSDecompressGetRequiredAlignments",
                (self.decompress_alignments)(DecompressOpts::new(data_type), &mut d),
            )?;
        }
        Ok(Alignments {
            input: c.input.max(d.input),
            output: c.output.max(d.output),
            temp: c.temp.max(d.temp),
        })
    }

    /// The most bytes one chunk of `chunk` bytes can compress to.
    pub fn max_output_chunk_size(
        &self,
        chunk: usize,
        data_type: i32,
    ) -> crate::error::Result<usize> {
        let mut out = 0;
        // SAFETY: options by value, valid out-pointer.
        let s =
            unsafe { (self.max_output_chunk_size)(chunk, CompressOpts::new(data_type), &mut out) };
        self.check("nvcompBatchedANSCompressGetMaxOutputChunkSize", s)?;
        Ok(out)
    }

    /// Device temporary bytes a compression and a decompression of `chunks` chunks of at most `chunk` bytes need
    /// (the larger of the two).
    pub fn temp_size(
        &self,
        chunks: usize,
        chunk: usize,
        data_type: i32,
    ) -> crate::error::Result<usize> {
        let (mut c, mut d) = (0, 0);
        let total = chunks * chunk;
        // SAFETY: options by value, valid out-pointers; these calls queue nothing on the (null) stream.
        unsafe {
            let opts = CompressOpts::new(data_type);
            let s =
                (self.compress_temp_size)(chunks, chunk, opts, &mut c, total, std::ptr::null_mut());
            self.check("nvcompBatchedANSCompressGetTempSize", s)?;
            let opts = DecompressOpts::new(data_type);
            let s = (self.decompress_temp_size)(
                chunks,
                chunk,
                opts,
                &mut d,
                total,
                std::ptr::null_mut(),
            );
            self.check("nvcompBatchedANSDecompressGetTempSize", s)?;
        }
        Ok(c.max(d))
    }

    /// Queue a batched compression of `n` chunks on `stream`.
    ///
    /// # Safety
    /// Every pointer is device memory of the current context: `ptrs_in`, `bytes_in`, `ptrs_out` arrays of `n`
    /// entries naming chunks of at most `max_chunk` bytes and output buffers of `max_output_chunk_size` bytes,
    /// `bytes_out` and `statuses` room for `n` entries, `temp` `temp_bytes` bytes, all aligned as `alignments`
    /// says and left alone until `stream` has passed the call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn compress(
        &self,
        data_type: i32,
        ptrs_in: u64,
        bytes_in: u64,
        max_chunk: usize,
        n: usize,
        temp: u64,
        temp_bytes: usize,
        ptrs_out: u64,
        bytes_out: u64,
        statuses: u64,
        stream: CUstream,
    ) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        let s = unsafe {
            (self.compress_async)(
                ptrs_in as *const *const c_void,
                bytes_in as *const usize,
                max_chunk,
                n,
                temp as *mut c_void,
                temp_bytes,
                ptrs_out as *const *mut c_void,
                bytes_out as *mut usize,
                CompressOpts::new(data_type),
                statuses as *mut Status,
                stream,
            )
        };
        self.check("nvcompBatchedANSCompressAsync", s)
    }

    /// Queue a batched decompression of `n` chunks on `stream`.
    ///
    /// # Safety
    /// As for `compress`: device arrays of `n` entries (compressed chunks and their sizes, output buffers and
    /// their sizes, room for actual sizes and statuses), `temp` of `temp_bytes`, untouched until `stream` passed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decompress(
        &self,
        data_type: i32,
        ptrs_in: u64,
        bytes_in: u64,
        buffer_bytes: u64,
        actual_bytes: u64,
        n: usize,
        temp: u64,
        temp_bytes: usize,
        ptrs_out: u64,
        statuses: u64,
        stream: CUstream,
    ) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        let s = unsafe {
            (self.decompress_async)(
                ptrs_in as *const *const c_void,
                bytes_in as *const usize,
                buffer_bytes as *const usize,
                actual_bytes as *mut usize,
                n,
                temp as *mut c_void,
                temp_bytes,
                ptrs_out as *const *mut c_void,
                DecompressOpts::new(data_type),
                statuses as *mut Status,
                stream,
            )
        };
        self.check("nvcompBatchedANSDecompressAsync", s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wheel_of_the_drivers_major_wins_and_none_newer_is_taken() {
        let c = vec![(12, PathBuf::from("/a/12")), (13, PathBuf::from("/a/13"))];
        assert_eq!(pick_wheel(&c, 13).unwrap().0, 13);
        assert_eq!(pick_wheel(&c, 12).unwrap().0, 12);
        assert_eq!(pick_wheel(&c, 14).unwrap().0, 13);
        assert!(pick_wheel(&c[1..], 12).is_none());
        assert!(pick_wheel(&[], 13).is_none());
    }

    #[test]
    fn a_missing_library_is_a_reason_not_a_panic() {
        let e = open("/nonexistent/libnvcomp.so.6", "a test").err().unwrap();
        assert!(matches!(e, OpenError::Load(_)));
        assert!(e.text().contains("libnvcomp"), "{}", e.text());
    }

    #[test]
    fn a_library_without_nvcomp_symbols_is_refused_by_name() {
        // libc is loaded in every process and has no nvCOMP entry points.
        let e = open("libc.so.6", "a test").err().unwrap();
        assert!(matches!(e, OpenError::Refused(_)));
        assert!(e.text().contains("nvcompGetProperties"), "{}", e.text());
    }

    /// With a real libnvcomp.so.6 (it loads without a GPU), the declarations are checked against it: the version,
    /// every symbol, and the host-side queries answering sensibly. The library is looked for as the allocator does
    /// when no wheel is handed over: `CUMEM_RS_NVCOMP_LIB`, else the system loader. Ignored by default (a machine
    /// without nvCOMP cannot run it, and a test that cannot run must not pass); run with `--ignored` where the
    /// library is, and then a missing library fails it.
    #[test]
    #[ignore = "needs nvCOMP 6 (CUMEM_RS_NVCOMP_LIB or libnvcomp.so.6 on the loader path)"]
    fn the_real_library_opens_and_answers_its_host_queries() {
        let path = std::env::var_os("CUMEM_RS_NVCOMP_LIB").filter(|p| !p.is_empty());
        let name = path.map_or_else(|| SONAME.to_string(), |p| p.to_string_lossy().into_owned());
        let nv = match open(&name, "a test") {
            Ok(nv) => nv,
            Err(e) => panic!("nvCOMP 6 ({name}) does not open: {}", e.text()),
        };
        assert_eq!(nv.version.0, MAJOR);
        for ty in [TYPE_CHAR, TYPE_FLOAT8_E4M3, TYPE_FLOAT16] {
            let a = nv.alignments(ty).unwrap();
            assert!(
                a.input >= 1 && a.input <= 16 && a.output <= 256 && a.temp <= 256,
                "{a:?}"
            );
            let max = nv.max_output_chunk_size(256 << 10, ty).unwrap();
            assert!((256 << 10..512 << 10).contains(&max), "{max}");
            let temp = nv.temp_size(128, 256 << 10, ty).unwrap();
            assert!(temp < 1 << 30, "{temp}");
            eprintln!(
                "type {ty}: alignments {a:?}, max chunk out {max}, temp for 128 chunks {temp}"
            );
        }
        assert_ne!(nv.status_name(12), "status 12");
    }
}
