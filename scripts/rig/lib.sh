# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings below are used by up and down
# Shared helpers for scripts/rig/up and scripts/rig/down. Sourced, not run.

export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

log()  { printf '[rig] %s\n' "$*" >&2; }
die()  { printf '[rig] ERROR: %s\n' "$*" >&2; exit 1; }

# --- locations -------------------------------------------------------------
RIG_DIR="${RIG_DIR:-$PWD/.rig}"
case "$RIG_DIR" in /*) ;; *) RIG_DIR="$PWD/$RIG_DIR" ;; esac
# Normalise (no need for the directory to exist yet).
RIG_DIR="$(realpath -m -- "$RIG_DIR")"
[ "$RIG_DIR" != "/" ] || die "RIG_DIR must not be /"
export RIG_DIR

RIG_MARKER="$RIG_DIR/.rig-dir"         # down only deletes directories carrying this
# Names this rig's things outside $RIG_DIR (socket dir, user comment, policy-rc.d),
# so that down can tell them from look-alikes made by someone else.
RIG_ID="$(printf '%s' "$RIG_DIR" | md5sum | cut -c1-12)"
# The non-root user that owns the PostgreSQL cluster: rigpg for a rig dir named .rig,
# a user of its own for any other (rigpg-<id>), so that a second rig running beside
# the default one shares no user with it (a rig's down deletes the user its up made,
# which userdel refuses while the other rig's PostgreSQL runs as it). A running rig's
# user is the one its up wrote down, whatever the caller's RIG_USER says.
RIG_USER_FILE="$RIG_DIR/rig-user"
if [ -s "$RIG_USER_FILE" ]; then
    RIG_USER="$(head -n1 "$RIG_USER_FILE")"
elif [ -z "${RIG_USER:-}" ]; then
    if [ "$(basename "$RIG_DIR")" = .rig ]; then RIG_USER=rigpg; else RIG_USER="rigpg-${RIG_ID:0:8}"; fi
fi
RIG_STATE="$RIG_DIR/.rig-state"        # changes up made outside $RIG_DIR (see below)
POLICY_RC_D=/usr/sbin/policy-rc.d
POLICY_MARK="# written by scripts/rig/up (rig $RIG_ID); scripts/rig/down removes it"
RIG_USER_COMMENT="scripts/rig/up (rig $RIG_ID)"

MY_DIR="$RIG_DIR/mariadb"
MY_DATA="$MY_DIR/data"
MY_CNF="$RIG_DIR/my.cnf"
MY_PID="$MY_DIR/mariadbd.pid"
MY_LOG="$RIG_DIR/mariadb.log"

PG_DIR="$RIG_DIR/pg"                   # owned by $RIG_USER
PG_DATA="$PG_DIR/data"
PG_LOG="$RIG_DIR/postgres.log"

# Unix sockets: sun_path is limited to 107 bytes. Keep them inside the rig dir
# when it is short enough, else fall back to a per-rig directory in /tmp.
SOCK_DIR="$RIG_DIR/run"
if [ $(( ${#SOCK_DIR} + 20 )) -gt 100 ]; then
    SOCK_DIR="/tmp/rig-sock-$RIG_ID"
fi
MY_SOCK="$SOCK_DIR/mysqld.sock"

# --- changes outside $RIG_DIR ---------------------------------------------------
# up writes each change it makes outside $RIG_DIR (a system user, chmod o+x on an
# ancestor, policy-rc.d, a /tmp socket dir, parent dirs of $RIG_DIR) to $RIG_STATE
# BEFORE making it, so an up killed half-way still leaves down the full list.
# One change a line, "KIND<TAB>WHAT". down undoes them newest first, and each undo
# is harmless when the change never happened (up died between record and change).
state_record() {  # state_record KIND WHAT
    printf '%s\t%s\n' "$1" "$2" >>"$RIG_STATE"
}
state_forget() {  # state_forget KIND WHAT : up undid the change itself already
    [ -f "$RIG_STATE" ] || return 0
    grep -vxF -- "$(printf '%s\t%s' "$1" "$2")" "$RIG_STATE" >"$RIG_STATE.new" || true
    mv -f -- "$RIG_STATE.new" "$RIG_STATE"
}

# --- binaries ----------------------------------------------------------------
find_pg_bin() {
    if [ -n "${PG_BIN:-}" ]; then printf '%s\n' "$PG_BIN"; return; fi
    if [ -x /usr/lib/postgresql/15/bin/postgres ]; then
        echo /usr/lib/postgresql/15/bin; return
    fi
    local d
    d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
    [ -n "$d" ] && [ -x "$d/postgres" ] && echo "$d"
}

find_mariadbd() {
    local c
    for c in mariadbd mysqld; do
        command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return 0; }
    done
    return 1
}

first_cmd() {  # first of the given command names that exists
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 && { echo "$c"; return 0; }
    done
    return 1
}

# --- process helpers --------------------------------------------------------
# pid_alive PIDFILE NAME-REGEX : prints pid when the pid file names a live
# process whose command line matches NAME-REGEX (guards against pid reuse).
pid_alive() {
    local f="$1" re="$2" pid
    [ -r "$f" ] || return 1
    pid="$(head -n1 "$f" 2>/dev/null | tr -dc '0-9')"
    [ -n "$pid" ] || return 1
    is_live "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -Eq "$re" || return 1
    echo "$pid"
}

my_pid() { pid_alive "$MY_PID" 'mariadbd|mysqld'; }
pg_pid() { pid_alive "$PG_DATA/postmaster.pid" 'postgres|postmaster'; }

# is_live PID : the process exists and is not a zombie. (PID 1 on these
# machines reaps orphans only every couple of seconds, so a stopped daemon
# lingers as a zombie that `kill -0` still reports as alive.)
is_live() {
    kill -0 "$1" 2>/dev/null || return 1
    local st
    st="$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null)"
    [ "$st" != Z ] && [ "$st" != X ]
}

# rig_procs : pids of server processes (and their initdb/bootstrap runs) whose
# command line names a path in this rig dir. An up killed half-way may have
# started a server that has not written its pid file yet; down finds it here.
rig_procs() { procs_under "$RIG_DIR"; }

# procs_under DIR [EXCEPT] : the same for any path inside DIR and not inside EXCEPT
# (down asks it whether another rig still runs below a directory it would chmod o-x).
procs_under() {
    local dir="$1" except="${2:-}" p pid prog arg ours
    for p in /proc/[0-9]*; do
        pid="${p#/proc/}"
        [ "$pid" != "$$" ] || continue
        ours=0; prog=""
        while IFS= read -r -d '' arg; do
            if [ -z "$prog" ]; then
                prog="${arg##*/}"
                case "$prog" in mariadbd|mysqld|postgres|postmaster|initdb|pg_ctl) ;; *) break ;; esac
                continue
            fi
            case "$arg" in "$dir"/*|*="$dir"/*) ;; *) continue ;; esac
            if [ -n "$except" ]; then
                case "$arg" in "$except"/*|*="$except"/*) continue ;; esac
            fi
            ours=1; break
        done <"$p/cmdline" 2>/dev/null
        [ "$ours" = 1 ] && is_live "$pid" && echo "$pid"
    done
    return 0
}

# wait_gone PID SECONDS
wait_gone() {
    local pid="$1" n=$(( $2 * 10 ))
    while is_live "$pid" && [ "$n" -gt 0 ]; do sleep 0.1; n=$((n - 1)); done
    ! is_live "$pid"
}

as_rig_user() { runuser -u "$RIG_USER" -- "$@"; }

port_in_use() {  # true when something accepts TCP connections on 127.0.0.1:$1
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# A server's port must lie outside the kernel's range of ephemeral ports: there
# any outgoing connection (a test's client, a Galera state transfer) may be given
# it as its local port, and the server then fails to bind at random. CI lost a
# run to this (node 2 on 33072: "Address already in use" though nothing listened).
warn_if_ephemeral() {  # warn_if_ephemeral PORT NAME
    local lo hi
    read -r lo hi < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || return 0
    if [ "$1" -ge "$lo" ] && [ "$1" -le "$hi" ]; then
        log "WARNING: $2 port $1 is inside the ephemeral range $lo-$hi; an outgoing connection may hold it and the server then fails to bind"
    fi
}

show_tail() {  # show_tail FILE
    if [ -r "$1" ]; then
        printf '[rig] ---- last lines of %s ----\n' "$1" >&2
        tail -n 40 "$1" >&2
        printf '[rig] ---- end of %s ----\n' "$1" >&2
    fi
}
