# A tool built once per version into ${REBOUND_CACHE:-$HOME/.cache/rebound}, for
# dev/build-control-plane.sh and dev/build-helm.sh. Sourced, not executed.
#
# Both take the same flags (--print-bin-dir, --force, --help) and build the same way: one
# build at a time per version dir (flock), a no-op when the stamp (a hash of everything that
# determines the output) and every binary are in place, the build into a temporary bin dir
# with a Go compiler cache of its own (nothing reuses it once the binaries are cached, and a
# Kubernetes build leaves GiBs), then moved into place and the stamp written last, so an
# interrupted build leaves nothing that looks done. The last stdout line is the bin dir.

# shellcheck shell=bash
# shellcheck source-path=SCRIPTDIR source=usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"

cb_die() {
  echo "error: $*" >&2
  exit 1
}
cb_log() { echo "${cb_name:?}: $*" >&2; }

# Reads the flags into cb_print_only and cb_force; --help prints the calling script's header.
cb_parse_flags() {
  cb_print_only=0
  cb_force=0
  local arg
  for arg in "$@"; do
    case "$arg" in
      --print-bin-dir) cb_print_only=1 ;;
      --force) cb_force=1 ;;
      -h | --help)
        usage_from_header "${BASH_SOURCE[-1]}"
        exit 0
        ;;
      *)
        echo "error: unknown argument '$arg' (try --help)" >&2
        exit 2
        ;;
    esac
  done
}

# cb_build VERSION_DIR STAMP LABEL BUILD_FN BINARY...
# Unless --force, returns at once when VERSION_DIR/stamp is STAMP and every BINARY is in
# VERSION_DIR/bin; otherwise runs `BUILD_FN TMP_BIN` (GOCACHE set to a temporary dir),
# checks every BINARY came out, and moves TMP_BIN to VERSION_DIR/bin. Prints the bin dir.
cb_build() {
  local version_dir="$1" stamp="$2" label="$3" build_fn="$4"
  shift 4
  local bin_dir="$version_dir/bin" binary
  mkdir -p "$version_dir"
  exec 9>"$version_dir/.lock"
  flock 9

  if ((cb_force == 0)) && [[ -f "$version_dir/stamp" && "$(cat "$version_dir/stamp")" == "$stamp" ]]; then
    local missing=0
    for binary in "$@"; do
      [[ -x "$bin_dir/$binary" ]] || missing=1
    done
    if ((missing == 0)); then
      cb_log "up to date: $label"
      echo "$bin_dir"
      return 0
    fi
  fi

  local start=$SECONDS
  cb_tmp_bin="$(mktemp -d "$version_dir/bin.tmp.XXXXXX")"
  chmod 755 "$cb_tmp_bin"
  cb_go_cache="$(mktemp -d "$version_dir/gocache.tmp.XXXXXX")"
  trap 'rm -rf "$cb_tmp_bin" "$cb_go_cache"' EXIT
  GOCACHE="$cb_go_cache" "$build_fn" "$cb_tmp_bin"
  for binary in "$@"; do
    [[ -x "$cb_tmp_bin/$binary" ]] || cb_die "the build did not produce $binary"
  done

  rm -rf "$bin_dir"
  mv "$cb_tmp_bin" "$bin_dir"
  rm -rf "$cb_go_cache"
  trap - EXIT
  echo "$stamp" >"$version_dir/stamp"
  cb_log "built in $((SECONDS - start))s: $(cd "$bin_dir" && du -sh -- "$@" | tr '\t\n' ' ')"
  echo "$bin_dir"
}
