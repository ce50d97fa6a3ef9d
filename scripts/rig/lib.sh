# shellcheck shell=bash
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

RIG_USER="${RIG_USER:-rigpg}"        # non-root user that owns the PostgreSQL cluster
RIG_MARKER="$RIG_DIR/.rig-dir"         # down only deletes directories carrying this

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
    SOCK_DIR="/tmp/rig-sock-$(printf '%s' "$RIG_DIR" | md5sum | cut -c1-12)"
fi
MY_SOCK="$SOCK_DIR/mysqld.sock"

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

show_tail() {  # show_tail FILE
    if [ -r "$1" ]; then
        printf '[rig] ---- last lines of %s ----\n' "$1" >&2
        tail -n 40 "$1" >&2
        printf '[rig] ---- end of %s ----\n' "$1" >&2
    fi
}
