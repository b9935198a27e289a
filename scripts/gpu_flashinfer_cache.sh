#!/usr/bin/env bash
# FlashInfer's JIT-built kernels carried from one GPU host to the next. A fresh host spends minutes
# compiling them before its first server or kernel test starts (FlashInfer's sampling kernels
# alone: 130 s on an H200, 2026-11-28), twice a session when a session needs two hosts.
#   on a host that built them (after the kernel tier or a server):  … gpu_flashinfer_cache.sh pack
#       (writes $OUT/fi_aot.tgz.aa, .ab, …: pieces under a call's 16 MiB per file)
#   here, from that call's files:  bash scripts/gpu_flashinfer_cache.sh keep /work/.device/N
#   on a fresh host, after .gpu/part2, carrying .gpu/fi_aot:  … gpu_flashinfer_cache.sh install
# They are installed as FlashInfer's ahead-of-time libraries (flashinfer/data/aot/NAME/NAME.so),
# which it loads without a build step, and only where the host's FlashInfer version and GPU arch
# are the ones they were built for (a library built for another arch would load and then fail).
# Run from the repo root; on the GPU host with PYTHONPATH=/tmp/site (FlashInfer's own paths).
# Tried here on a stand-in FlashInfer only (2026-11-28): its first GPU host is still to come.
set -euo pipefail
part=.gpu/fi_aot
# the JIT folder below FlashInfer's cache (VERSION/ARCH/cached_ops), and the AOT folder; a
# FlashInfer that does not import stops the script here (set -e), not at a path left empty
flashinfer_paths() {
  python3 -c "from flashinfer.jit import env
print(env.FLASHINFER_JIT_DIR.relative_to(env.FLASHINFER_CACHE_DIR), env.FLASHINFER_AOT_DIR)"
}
case "${1:-}" in
  pack)
    paths=$(flashinfer_paths)
    read -r jit_dir _ <<< "$paths"
    cd "$HOME/.cache/flashinfer"
    libraries=$(mktemp) && find "$jit_dir" -name '*.so' > "$libraries"
    tar -czf - -T "$libraries" | split -b 15m - "${OUT:?pack writes under \$OUT}/fi_aot.tgz."
    echo "packed $(wc -l < "$libraries") libraries of $jit_dir: $(ls "$OUT"/fi_aot.tgz.*)" ;;
  keep)
    [[ $# -ge 2 ]] || { echo "usage: $0 keep FILES_DIR (a call's files)" >&2; exit 2; }
    rm -rf "$part" && mkdir -p "$part" && cp "$2"/fi_aot.tgz.* "$part"/
    echo "kept in $part: $(ls "$part")" ;;
  install)
    paths=$(flashinfer_paths)
    read -r jit_dir aot_dir <<< "$paths"
    unpacked=$(mktemp -d) && cat "$part"/fi_aot.tgz.* | tar -C "$unpacked" -xzf -
    if [[ ! -d "$unpacked/$jit_dir" ]]; then
      echo "$part holds $(cd "$unpacked" && ls -d */*/), not $jit_dir: nothing installed"; exit 0
    fi
    for lib in "$unpacked/$jit_dir"/*/*.so; do
      name=$(basename "$(dirname "$lib")")
      mkdir -p "$aot_dir/$name" && cp "$lib" "$aot_dir/$name/"
    done
    echo "installed $(ls "$unpacked/$jit_dir" | wc -l) FlashInfer libraries into $aot_dir" ;;
  *) echo "usage: $0 pack|keep FILES_DIR|install" >&2; exit 2 ;;
esac
