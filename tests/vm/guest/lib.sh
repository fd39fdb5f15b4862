# Helpers for VM-tier scenario scripts (bash). Sourced before the scenario runs in the guest;
# the conformance script sources it on the host too.
#   pass NAME                 record a passed check
#   fail NAME DETAIL          record a failed check
#   check NAME CMD...         pass if CMD exits 0, else fail with the tail of its output
#   expect_eq NAME WANT GOT   pass if equal, else fail saying both
#   try_write FILE VALUE      write VALUE (no newline added) to FILE in one write(2); prints
#                             "ok" or the errno name (ENODEV, EINVAL, ...)
#   wait_for SECONDS CMD...   retry CMD every 0.1 s until it succeeds or SECONDS (wall clock) pass
# Results go to $VMTIER_RESULTS/results as "PASS <name>" / "FAIL <name>: <detail>".

: "${VMTIER_RESULTS:=.}"

_record() { printf '%s\n' "$*" >>"$VMTIER_RESULTS/results"; echo "$*"; }
pass() { _record "PASS $1"; }
fail() { _record "FAIL $1: $(printf '%s' "${2:-}" | tr '\n' ' ' | cut -c1-400)"; }

check() {
    local name="$1" out
    shift
    if out="$("$@" 2>&1)"; then
        pass "$name"
    else
        fail "$name" "\`$*\` failed: $(printf '%s\n' "$out" | tail -5)"
    fi
}

expect_eq() {
    if [ "$2" = "$3" ]; then pass "$1"; else fail "$1" "want '$2', got '$3'"; fi
}

errno_name() {
    case "$1" in
        *"No such device or address"*) echo ENXIO ;;
        *"No such device"*) echo ENODEV ;;
        *"Invalid argument"*) echo EINVAL ;;
        *"File exists"*) echo EEXIST ;;
        *"No space left on device"*) echo ENOSPC ;;
        *"Permission denied"*) echo EACCES ;;
        *"Device or resource busy"*) echo EBUSY ;;
        *"No such file or directory"*) echo ENOENT ;;
        *"Operation not permitted"*) echo EPERM ;;
        *"Input/output error"*) echo EIO ;;
        *"Read-only file system"*) echo EROFS ;;
        *"Resource temporarily unavailable"*) echo EAGAIN ;;
        *"Operation not supported"*) echo EOPNOTSUPP ;;
        *) echo "error($1)" ;;
    esac
}

try_write() {
    local err
    if err="$( (printf '%s' "$2" >"$1") 2>&1)"; then
        echo ok
    else
        errno_name "$err"
    fi
}

# Reads a file; prints the errno name instead when the read fails.
try_read() {
    local out
    if out="$(cat "$1" 2>&1)"; then
        printf '%s\n' "$out"
    else
        errno_name "$out"
    fi
}

wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    while ! "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.1
    done
}
