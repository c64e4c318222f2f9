// Build script: with the `build-cubins` feature, compiles every kernels/*.cu to cubins for sm_90a
// and sm_120a plus PTX for compute_90 (DESIGN.md section 5) and writes `embedded.rs` into OUT_DIR,
// which src/embedded.rs includes. Without the feature it does nothing, so CPU-only builds never
// need the CUDA toolkit.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// (file suffix, nvcc arguments selecting the target) for each embedded image.
const TARGETS: [(&str, &[&str]); 3] = [
    (
        "sm_90a.cubin",
        &["-cubin", "-gencode=arch=compute_90a,code=sm_90a"],
    ),
    (
        "sm_120a.cubin",
        &["-cubin", "-gencode=arch=compute_120a,code=sm_120a"],
    ),
    (
        "compute_90.ptx",
        &["-ptx", "-gencode=arch=compute_90,code=compute_90"],
    ),
];

const INSTALL_HINT: &str = "nvcc from CUDA 13.0 is needed to build ninfer's CUDA kernels \
(feature `build-cubins`, turned on by ninfer's `cuda` feature). Install it with \
`scripts/install_nvcc.sh` (pip packages nvidia-cuda-nvcc 13.0.x and friends into the current \
python or a venv), or point the build at a toolkit with NVCC=/path/to/nvcc or CUDA_HOME=/usr/local/cuda. \
If nvcc lives in another interpreter's site-packages, set NINFER_NVCC_PYTHON=/path/to/python.";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_BUILD_CUBINS").is_none() {
        return;
    }
    for var in [
        "NVCC",
        "CUDA_HOME",
        "NINFER_NVCC_PYTHON",
        "NINFER_NVCC_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // The watched paths are relative to this package, not absolute: the build script's output
    // is keyed without the checkout's path, so two checkouts sharing one target directory
    // would otherwise each watch the other's kernels and take its cubins. Cargo compares
    // modification times with its last run, so a checkout whose kernels are older than that
    // run still needs `touch kernels/*.cu` (or a target directory of its own).
    const KERNELS: &str = "../../kernels";
    println!("cargo:rerun-if-changed={KERNELS}");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let kernel_dir = manifest.join(KERNELS);
    let kernel_dir = kernel_dir.canonicalize().unwrap_or(kernel_dir);

    let mut sources = Vec::new();
    let entries = fs::read_dir(&kernel_dir).unwrap_or_else(|e| {
        panic!(
            "cannot read kernel sources in {}: {e}",
            kernel_dir.display()
        )
    });
    for entry in entries.flatten() {
        let path = entry.path();
        println!("cargo:rerun-if-changed={KERNELS}/{}", entry.file_name().to_string_lossy());
        if path.extension().is_some_and(|x| x == "cu") {
            sources.push(path);
        }
    }
    sources.sort();
    if sources.is_empty() {
        panic!("no .cu files in {}", kernel_dir.display());
    }

    let nvcc = find_nvcc().unwrap_or_else(|| panic!("{INSTALL_HINT}"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("kernels");
    fs::create_dir_all(&out_dir).expect("create OUT_DIR/kernels");

    let extra: Vec<String> = env::var("NINFER_NVCC_FLAGS")
        .map(|s| s.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let jobs: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
        .max(1);

    let mut pending: Vec<(PathBuf, PathBuf, &[&str])> = Vec::new();
    for src in &sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 kernel file name");
        for (suffix, args) in TARGETS {
            pending.push((src.clone(), out_dir.join(format!("{stem}.{suffix}")), args));
        }
    }
    let mut running: Vec<(Child, PathBuf)> = Vec::new();
    let mut failures = Vec::new();
    while !pending.is_empty() || !running.is_empty() {
        while running.len() < jobs {
            let Some((src, out, args)) = pending.pop() else {
                break;
            };
            let child = Command::new(&nvcc)
                .args(args)
                .args(["-O3", "-std=c++17", "-Xptxas=-warn-spills", "-I"])
                .arg(&kernel_dir)
                .args(&extra)
                .arg("-o")
                .arg(&out)
                .arg(&src)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}\n{INSTALL_HINT}", nvcc.display()));
            running.push((child, out));
        }
        let (child, out) = running.remove(0);
        let result = child.wait_with_output().expect("wait for nvcc");
        let stderr = String::from_utf8_lossy(&result.stderr);
        for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo:warning=nvcc: {line}");
        }
        if !result.status.success() {
            failures.push(format!("{}:\n{stderr}", out.display()));
        }
    }
    if !failures.is_empty() {
        panic!("nvcc ({}) failed:\n{}", nvcc.display(), failures.join("\n"));
    }
    write_embedded(&sources, &out_dir);
}

/// Writes OUT_DIR/embedded.rs: one `ModuleImage` per kernel file, images included as bytes.
fn write_embedded(sources: &[PathBuf], out_dir: &Path) {
    let mut code = String::from("pub(crate) static MODULE_IMAGES: &[ModuleImage] = &[\n");
    for src in sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 kernel file name");
        let file = |suffix: &str| {
            out_dir
                .join(format!("{stem}.{suffix}"))
                .display()
                .to_string()
        };
        writeln!(
            code,
            "    ModuleImage {{ name: {stem:?}, sm90a: include_bytes!({:?}), \
             sm120a: include_bytes!({:?}), ptx: include_bytes!({:?}) }},",
            file(TARGETS[0].0),
            file(TARGETS[1].0),
            file(TARGETS[2].0)
        )
        .expect("format");
    }
    code.push_str("];\n");
    let dest = out_dir.parent().expect("OUT_DIR").join("embedded.rs");
    fs::write(dest, code).expect("write embedded.rs");
}

/// nvcc from, in order: $NVCC, $CUDA_HOME/bin, PATH, the pip wheel (nvidia-cuda-nvcc) in the
/// site-packages of $NINFER_NVCC_PYTHON and of `python3`, then /usr/local/cuda.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        panic!("NVCC={} is not a file", p.display());
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let mut pythons: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("NINFER_NVCC_PYTHON") {
        pythons.push(PathBuf::from(p));
    }
    pythons.push(PathBuf::from("python3"));
    for python in pythons {
        for site in site_packages(&python) {
            let p = site.join("nvidia/cu13/bin/nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = PathBuf::from("/usr/local/cuda/bin/nvcc");
    p.is_file().then_some(p)
}

fn site_packages(python: &Path) -> Vec<PathBuf> {
    let script = "import site, sys\n\
                  paths = list(getattr(site, 'getsitepackages', lambda: [])())\n\
                  paths.append(site.getusersitepackages())\n\
                  paths += [p for p in sys.path if p.endswith('site-packages')]\n\
                  print('\\n'.join(paths))";
    let Ok(out) = Command::new(python)
        .args(["-c", script])
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect()
}
