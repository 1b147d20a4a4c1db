#!/usr/bin/env bash
# Build the CPU variant of the megatron-rl image without a Docker daemon, run the README's quick
# start and the fast test tier inside it, and report the build time and the image size.
#
#   bash scripts/build_image.sh [--mirror URL] [--cold] [--no-quickstart] [--no-tests]
#                               [--gpu-steps] [--keep]
#
# 1. buildah and debootstrap (Debian packages) are installed if missing (needs root).
# 2. The base, localhost/megatron-rl-base:bookworm, is made if absent: Debian bookworm (Python
#    3.11, the version requirements-cpu.txt pins for) by debootstrap, with python3-pip and
#    PIP_BREAK_SYSTEM_PACKAGES=1, so that `pip` installs into the image's Python as in NGC.
#    debootstrap fetches from the Debian mirror given by --mirror URL or $DEBIAN_MIRROR, else from
#    the one the host's apt uses (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list and
#    *.sources: an entry for suite bookworm, else any .../debian archive); with none of these it
#    stops and says so. A base that is already there needs no mirror.
# 3. The one Dockerfile is built on it (--build-arg BASE_IMAGE=...): the same install steps as
#    the GPU image (scripts/docker_install.sh), with the CPU torch and no rollout server.
# 4. In a container of the image (`buildah run --isolation chroot`): `bash scripts/quickstart.sh`,
#    then the fast tier `bash scripts/test.sh -m "$FAST_TIER"`.
# 5. --gpu-steps: the GPU image's steps as far as they go without NGC: the Dockerfile with its GPU
#    defaults, on a stand-in base that, like NGC, already has a torch (the CPU one), and with the
#    vLLM / SGLang installs only resolved (pip --dry-run) instead of downloading their CUDA builds.
# A report (markdown) goes to $OUT/report.md, the logs beside it.
#
# --cold: remove the image, the base and buildah's pip cache first (a from-scratch timing).
# Settings (environment): IMAGE, BASE, ROOTFS (debootstrap folder), OUT, DEBIAN_MIRROR (the
# same as --mirror), FAST_TIER, CONTEXT (the build context, default this checkout; .dockerignore leaves out .git,
# .venv*, outputs/ and built .so files), TORCH_WHEELS (a folder holding torch-<pin>+cpu-*.whl,
# mounted read-only into the build; default /opt/wheels when it has one, else the build takes
# the wheel from download.pytorch.org/whl/cpu).
# Run the whole script at low priority on a shared machine: `nice -n 19 bash scripts/build_image.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

IMAGE=${IMAGE:-localhost/megatron-rl:cpu}
BASE=${BASE:-localhost/megatron-rl-base:bookworm}
STANDIN=${STANDIN:-localhost/megatron-rl-standin-base:bookworm-torch}
ROOTFS=${ROOTFS:-/var/tmp/megatron-rl-rootfs}
OUT=${OUT:-$REPO/outputs/build_image}
CONTEXT=${CONTEXT:-$REPO}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-}
FAST_TIER=${FAST_TIER:-not distributed and not server}
CACHE_DIR=/var/tmp/buildah-cache   # where buildah 1.28 keeps RUN --mount=type=cache folders
COLD=0 QUICKSTART=1 TESTS=1 GPU_STEPS=0 KEEP=0
while [ "$#" -gt 0 ]; do
    arg=$1
    shift
    case "$arg" in
    --mirror)
        [ "$#" -gt 0 ] || { echo "--mirror needs a URL" >&2; exit 2; }
        DEBIAN_MIRROR=$1
        shift ;;
    --mirror=*) DEBIAN_MIRROR=${arg#--mirror=} ;;
    --cold) COLD=1 ;;
    --no-quickstart) QUICKSTART=0 ;;
    --no-tests) TESTS=0 ;;
    --gpu-steps) GPU_STEPS=1 ;;
    --keep) KEEP=1 ;;   # keep the container the checks ran in
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
B() { buildah --storage-driver vfs "$@"; }
export BUILDAH_ISOLATION=chroot   # the default OCI isolation does not work in an unprivileged sandbox
log() { echo "[build_image] $*" | tee -a "$OUT/summary.log"; }
secs() { date +%s; }

# "URI SUITE" for every binary-package source the host's apt reads, one-line (.list) and deb822
# (.sources) formats; disabled entries (Enabled: no) and deb-src are left out.
apt_entries() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 {print $2, $3}'
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        awk 'function flush(   i, j, nu, ns, u, s) {
                 if (f["types"] ~ /(^| )deb( |$)/ && tolower(f["enabled"]) != "no") {
                     nu = split(f["uris"], u, " "); ns = split(f["suites"], s, " ")
                     for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print u[i], s[j]
                 }
                 split("", f); key = ""
             }
             /^[ \t]*#/ { next }
             /^[ \t]*$/ { flush(); next }
             /^[ \t]/ { if (key != "") f[key] = f[key] " " $0; next }   # continuation line
             match($0, /^[A-Za-z-]+:/) {
                 key = tolower(substr($0, 1, RLENGTH - 1)); f[key] = substr($0, RLENGTH + 1)
                 gsub(/^[ \t]+|[ \t]+$/, "", f[key])
             }
             END { flush() }' "$f"
    done
}

# The Debian archive the host's apt uses: an entry for bookworm, else any .../debian archive
# with a plain release suite (not -security / -updates).
host_debian_mirror() {
    apt_entries | awk 'bookworm == "" && $2 == "bookworm" { bookworm = $1 }
                       other == "" && $1 ~ /\/debian\/?$/ && $2 !~ /-/ { other = $1 }
                       END { print (bookworm != "" ? bookworm : other) }'
}
human() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
: > "$OUT/summary.log"

# --- 1. tools ---------------------------------------------------------------------------------
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing buildah and debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap >/dev/null
fi
log "$(buildah --version)"

if [ "$COLD" = 1 ]; then
    log "--cold: removing $IMAGE, $BASE, $STANDIN, $ROOTFS and $CACHE_DIR"
    for img in "$IMAGE" "$STANDIN" "$BASE"; do
        B rmi -f "$img" >/dev/null 2>&1 || true
    done
    rm -rf "$ROOTFS" "$CACHE_DIR"
fi

# --- 2. base ----------------------------------------------------------------------------------
t_base=0
if [ -z "$(B images -q "$BASE" 2>/dev/null)" ]; then
    t0=$(secs)
    if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
        if [ -z "$DEBIAN_MIRROR" ]; then
            DEBIAN_MIRROR=$(host_debian_mirror || true)
            [ -n "$DEBIAN_MIRROR" ] || {
                log "no Debian mirror: the host's apt sources (/etc/apt/sources.list," \
                    "/etc/apt/sources.list.d/*.list, *.sources) name no Debian archive for" \
                    "bookworm. Give one: --mirror URL or DEBIAN_MIRROR=URL" \
                    "(e.g. http://deb.debian.org/debian or your site's mirror)"
                exit 2
            }
            log "Debian mirror $DEBIAN_MIRROR (from the host's apt sources)"
        fi
        rm -rf "$ROOTFS"
        log "debootstrap bookworm from $DEBIAN_MIRROR -> $ROOTFS"
        debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
            bookworm "$ROOTFS" "$DEBIAN_MIRROR" > "$OUT/debootstrap.log" 2>&1 \
            || { tail -20 "$OUT/debootstrap.log"; exit 1; }
    fi
    ctr=$(B from scratch)
    mnt=$(B mount "$ctr")
    cp -a "$ROOTFS/." "$mnt/"
    # like Debian's own images: no downloaded packages or package lists (~100 MB)
    rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/lib/apt/lists/*
    B umount "$ctr" >/dev/null
    B config --env LANG=C.UTF-8 --env PIP_BREAK_SYSTEM_PACKAGES=1 \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$ctr"
    B commit -q "$ctr" "$BASE" >/dev/null
    B rm "$ctr" >/dev/null
    t_base=$(($(secs) - t0))
    log "base $BASE made in $(human $t_base)"
else
    log "base $BASE present (reused; --cold remakes it)"
fi

# --- 3. the image -----------------------------------------------------------------------------
# pip in a build reaches PyPI only with the host's CA bundle; the local CPU torch wheel, if any,
# is mounted read-only and found through TORCH_FIND_LINKS.
torch_pin=$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$CONTEXT/requirements-cpu.txt")
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg INSTALL_VLLM=0 --build-arg MAX_JOBS=2)
mounts=() find_links=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
if compgen -G "$TORCH_WHEELS/torch-${torch_pin}+cpu-*.whl" >/dev/null; then
    mounts+=(-v "$TORCH_WHEELS:/opt/torch-wheels:ro")
    build_args+=(--build-arg TORCH_FIND_LINKS=/opt/torch-wheels --build-arg TORCH_INDEX_URL=)
    find_links=(--find-links /opt/torch-wheels)
    log "torch ${torch_pin}+cpu from $TORCH_WHEELS"
fi
cache_before=$(du -sh "$CACHE_DIR" 2>/dev/null | cut -f1 || true)
log "building $IMAGE (pip cache mount: ${cache_before:-empty})"
t0=$(secs)
B rmi -f "$IMAGE" >/dev/null 2>&1 || true
B bud --isolation chroot "${mounts[@]}" "${build_args[@]}" -f "$CONTEXT/Dockerfile" -t "$IMAGE" "$CONTEXT" \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; log "build FAILED (log: $OUT/build.log)"; exit 1; }
t_build=$(($(secs) - t0))
log "image built in $(human $t_build) (base: $(human $t_base))"
grep -E '^\[docker_install\]|^megatron-rl ok' "$OUT/build.log" | tee -a "$OUT/summary.log"

size_img=$(B images --format '{{.Size}}' "$IMAGE")
size_base=$(B images --format '{{.Size}}' "$BASE")
ctr=$(B from "$IMAGE")
size_rootfs=$(du -sh --exclude=proc --exclude=sys --exclude=dev "$(B mount "$ctr")" | cut -f1)
B umount "$ctr" >/dev/null
size_store=$(du -sh /var/lib/containers/storage 2>/dev/null | cut -f1)
log "image size: $size_img (buildah images; base $size_base), root filesystem $size_rootfs (du)," \
    "vfs storage $size_store"

# --- 4. quick start and fast tier inside it ---------------------------------------------------
in_ctr() { B run --isolation chroot "$ctr" -- bash -c "cd /opt/megatron-rl && $1"; }
qs_line="not run" qs_time=0 qs_rc=-
if [ "$QUICKSTART" = 1 ]; then
    log "quick start: bash scripts/quickstart.sh"
    t0=$(secs)
    set +e
    in_ctr "bash scripts/quickstart.sh" 2>&1 | tee "$OUT/quickstart.log"
    qs_rc=${PIPESTATUS[0]}
    set -e
    qs_time=$(($(secs) - t0))
    qs_line=$(grep -E '^held-out accuracy' "$OUT/quickstart.log" | tail -1 || true)
    log "quick start: rc $qs_rc in $(human $qs_time): ${qs_line:-no result line}"
fi
t_line="not run" t_time=0 t_rc=-
if [ "$TESTS" = 1 ]; then
    log "fast tier: bash scripts/test.sh -m \"$FAST_TIER\""
    t0=$(secs)
    set +e
    in_ctr "MEGATRON_RL_SKIP_VLLM=1 MEGATRON_RL_SKIP_SGLANG=1 bash scripts/test.sh -m '$FAST_TIER' -rs" \
        2>&1 | tee "$OUT/tests.log"
    t_rc=${PIPESTATUS[0]}
    set -e
    t_time=$(($(secs) - t0))
    t_line=$(grep -E '^=*.*[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//' || true)
    log "fast tier: rc $t_rc in $(human $t_time): ${t_line:-no summary line}"
fi
if [ "$KEEP" = 1 ]; then log "container kept: $ctr"; else B rm "$ctr" >/dev/null; fi

# --- 5. the GPU image's steps, as far as they go without NGC -----------------------------------
g_line="not run" t_gpu=0
if [ "$GPU_STEPS" = 1 ]; then
    log "GPU steps: stand-in base $STANDIN (the base + torch, as NGC has one)"
    if [ -z "$(B images -q "$STANDIN" 2>/dev/null)" ]; then
        sctr=$(B from "$BASE")
        B run --isolation chroot "${mounts[@]}" "$sctr" -- \
            pip install -q "${find_links[@]}" "torch==${torch_pin}+cpu" > "$OUT/standin.log" 2>&1
        B commit -q "$sctr" "$STANDIN" >/dev/null
        B rm "$sctr" >/dev/null
    fi
    t0=$(secs)
    set +e
    # the Dockerfile's defaults (INSTALL_VLLM=1 -> resolve, TORCH_CUDA_ARCH_LIST, MAX_JOBS=8)
    B bud --isolation chroot "${mounts[@]}" --build-arg "BASE_IMAGE=$STANDIN" \
        --build-arg INSTALL_VLLM=resolve --build-arg INSTALL_SGLANG=resolve \
        -f "$CONTEXT/Dockerfile" -t localhost/megatron-rl:gpu-steps "$CONTEXT" > "$OUT/gpu-steps.log" 2>&1
    g_rc=$?
    set -e
    t_gpu=$(($(secs) - t0))
    grep -E '^\[docker_install\]|^megatron-rl ok' "$OUT/gpu-steps.log" | tee -a "$OUT/summary.log"
    g_line="rc $g_rc in $(human $t_gpu)"
    log "GPU steps: $g_line (log: $OUT/gpu-steps.log)"
    B rmi -f localhost/megatron-rl:gpu-steps >/dev/null 2>&1 || true
fi

# --- report -----------------------------------------------------------------------------------
cat > "$OUT/report.md" <<EOF
# CPU image: build and checks ($(date -u +%Y-%m-%d), $(nproc) cores, $(buildah --version | cut -d' ' -f1-3), vfs)

| | |
|---|---|
| base ($BASE, debootstrap + import) | $( [ "$t_base" = 0 ] && echo "reused" || human "$t_base") |
| image build ($IMAGE) | $(human "$t_build") |
| image size | $size_img (buildah images; base $size_base); root filesystem $size_rootfs |
| torch in the image | $(grep -m1 -oE 'torch [0-9][^,]*, CUDA [A-Za-z0-9.]+' "$OUT/build.log" || echo '?') |
| quick start (\`bash scripts/quickstart.sh\`) | rc $qs_rc, $(human "$qs_time"): ${qs_line} |
| fast tier (\`bash scripts/test.sh -m "$FAST_TIER"\`) | rc $t_rc, $(human "$t_time"): ${t_line} |
| GPU steps on a stand-in base (--gpu-steps) | ${g_line} |
EOF
log "report: $OUT/report.md"
cat "$OUT/report.md"
[ "$qs_rc" = 0 ] || [ "$qs_rc" = - ] || exit 1
[ "$t_rc" = 0 ] || [ "$t_rc" = - ] || exit 1
