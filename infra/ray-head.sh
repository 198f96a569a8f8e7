#!/usr/bin/env bash
# Start / stop a Ray head node with token authentication (Ray 2.60: `ray job submit` needs it).
#
#   bash infra/ray-head.sh start [extra `ray start` options]   # e.g. --num-gpus 1
#   bash infra/ray-head.sh status | token | env | stop
#
# start  generates a token if none exists, starts the head (dashboard / job API on 127.0.0.1 unless
#        DASHBOARD_HOST is set) and writes $RAY_HEAD_DIR/env, which a submitter can source.
# token  prints the token, generating one if none exists (give it to submitters: RAY_AUTH_TOKEN=...,
#        or a file + RAY_AUTH_TOKEN_PATH).
# stop   stops only THIS head: the processes of the session it was started in and their children.
#        (`ray stop` would kill every Ray process of every user on the machine.)
#
# Environment (defaults in brackets):
#   RAY_HEAD_DIR        state + Ray temp dir, keep it short (unix socket paths)  [/tmp/vit-ray-head]
#   RAY_PORT            GCS port (workers join with `ray start --address HEAD:RAY_PORT`)  [6379]
#   DASHBOARD_HOST      dashboard / job API bind address; 0.0.0.0 to accept other machines  [127.0.0.1]
#   DASHBOARD_PORT      dashboard / job API port  [8265]
#   RAY_CLIENT_PORT     Ray Client server port  [10001]
#   RAY_AGENT_PORT      dashboard agent HTTP port  [52365]
#   RAY_NUM_CPUS, RAY_NUM_GPUS   resources to advertise  [detected]
#   RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH   token or token file; else ~/.ray/auth_token
#                       (created by `ray get-auth-token --generate` when missing)
#   RAY_STOP_GRACE      seconds between SIGTERM and SIGKILL on stop  [10]
# Note: the GCS and raylet ports listen on all interfaces (Ray has no switch for that); every RPC
# needs the token, and on a cluster a firewall / security group should admit only the cluster.
set -euo pipefail

cmd=${1:-}
[[ $# -gt 0 ]] && shift
dir=${RAY_HEAD_DIR:-/tmp/vit-ray-head}
port=${RAY_PORT:-6379}
dhost=${DASHBOARD_HOST:-127.0.0.1}
dport=${DASHBOARD_PORT:-8265}
export RAY_AUTH_MODE=token

die() { echo "ray-head: $*" >&2; exit 1; }
no_options() { [[ $# -eq 0 ]] || { echo "ray-head: $cmd takes no options (got: $*); only start passes them to ray" >&2; exit 2; }; }
case $cmd in  # the help needs no ray
  -h|--help|help|"") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; [[ -n $cmd ]] && exit 0; exit 2 ;;
esac
for var in RAY_PORT DASHBOARD_PORT RAY_CLIENT_PORT RAY_AGENT_PORT RAY_NUM_CPUS RAY_NUM_GPUS RAY_STOP_GRACE; do
  [[ ${!var:-0} =~ ^[0-9]+$ ]] || { echo "ray-head: $var=${!var} is not a whole number" >&2; exit 2; }
done
command -v ray >/dev/null || die "ray not found on PATH (source .venv/bin/activate)"

# A subshell: its umask makes the token file private from its creation (a chmod after it left a
# moment in which others could read it), and the caller's umask stays as it was.
ensure_token() (
  [[ -n ${RAY_AUTH_TOKEN:-} ]] && return
  umask 077
  if [[ -n ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    [[ ! -d $RAY_AUTH_TOKEN_PATH ]] || die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is a folder: name the token's file"
    [[ -s $RAY_AUTH_TOKEN_PATH ]] && return
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")" 2>/dev/null ||
      die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH: cannot create its folder"
    # Ray's generator writes ~/.ray/auth_token: run it with a private HOME, move the file into place.
    local home
    home=$(mktemp -d)
    trap 'rm -rf "$home"' EXIT
    env -u RAY_AUTH_TOKEN_PATH HOME="$home" ray get-auth-token --generate >/dev/null
    install -m 600 "$home/.ray/auth_token" "$RAY_AUTH_TOKEN_PATH" 2>/dev/null ||
      die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH: cannot write the token there"
  else
    ray get-auth-token --generate >/dev/null  # no-op when ~/.ray/auth_token exists
    chmod 600 "$HOME/.ray/auth_token"
  fi
)

# Every process of the head: the session started by `start` (recorded in $dir/sid) plus all their
# descendants (Ray workers and job drivers may move to sessions / groups of their own).
head_pids() {
  [[ -s $dir/sid ]] || return 0
  # still ours? (a member still names our temp dir; guards against a recycled session id)
  ps -ww -o args= -s "$(cat "$dir/sid")" 2>/dev/null | grep -qF -- "$dir/ray" || return 0
  ps -eo pid=,ppid=,sid= | awk -v g="$(cat "$dir/sid")" -v self=$$ '
    { pid[NR] = $1; ppid[NR] = $2; sid[NR] = $3 }
    END {
      for (i = 1; i <= NR; i++) if (sid[i] == g) keep[pid[i]] = 1
      do { changed = 0
           for (i = 1; i <= NR; i++) if (!(pid[i] in keep) && (ppid[i] in keep)) { keep[pid[i]] = 1; changed = 1 }
      } while (changed)
      for (p in keep) if (p != self) print p
    }'
}

alive_pids() { for p in "$@"; do kill -0 "$p" 2>/dev/null && echo "$p"; done; return 0; }

api_host() { [[ $dhost == 0.0.0.0 || $dhost == "::" ]] && echo 127.0.0.1 || echo "$dhost"; }

case $cmd in
  start)
    [[ -n $(head_pids) ]] && die "a head started from $dir is already running (bash infra/ray-head.sh stop)"
    # Taken ports: `ray start` still exits 0 when it cannot bind the job API (it only logs it), and
    # submitters then reach whatever holds the port (another head's jobs API, or a 404).
    for spec in "$port RAY_PORT GCS" "$dport DASHBOARD_PORT job-API"; do
      read -r p var what <<< "$spec"
      if (exec 3<>"/dev/tcp/$(api_host)/$p") 2>/dev/null; then
        die "port $p ($what, $var) on $(api_host) is already in use: stop what holds it, or set $var to a free port"
      fi
    done
    mkdir -p "$dir"
    ensure_token
    args=(--head --port "$port" --dashboard-host "$dhost" --dashboard-port "$dport"
          --ray-client-server-port "${RAY_CLIENT_PORT:-10001}"
          --dashboard-agent-listen-port "${RAY_AGENT_PORT:-52365}"
          --temp-dir "$dir/ray" --disable-usage-stats)
    [[ -n ${RAY_NUM_CPUS:-} ]] && args+=(--num-cpus "$RAY_NUM_CPUS")
    [[ -n ${RAY_NUM_GPUS:-} ]] && args+=(--num-gpus "$RAY_NUM_GPUS")
    command -v setsid >/dev/null || die "setsid (util-linux) is needed to start a head that stop can find again"
    # A new session whose id is recorded: `stop` finds exactly these processes again.
    setsid -w bash -c 'echo $$ > "$1"; shift; exec ray start "$@"' _ "$dir/sid" "${args[@]}" "$@" \
      > "$dir/start.log" 2>&1 || { cat "$dir/start.log" >&2; "$0" stop >/dev/null 2>&1 || true; die "ray start failed"; }
    {
      echo "export RAY_AUTH_MODE=token"
      # %q: the file is sourced, and the path may hold spaces or shell characters
      [[ -n ${RAY_AUTH_TOKEN_PATH:-} ]] && printf 'export RAY_AUTH_TOKEN_PATH=%q\n' "$RAY_AUTH_TOKEN_PATH"
      echo "export RAY_API_SERVER_ADDRESS=http://$(api_host):$dport"
      echo "export RAY_HEAD_GCS_ADDRESS=$(hostname -I 2>/dev/null | awk '{print $1}'):$port"
    } > "$dir/env"
    echo "Ray head up: job API http://$(api_host):$dport (token auth), GCS port $port, logs $dir/ray/session_latest/logs"
    echo "Submit: source $dir/env && bash infra/submit.sh        Stop: bash infra/ray-head.sh stop"
    ;;
  stop)
    no_options "$@"
    pids=$(head_pids)
    if [[ -z $pids ]]; then echo "no head running from $dir"; exit 0; fi
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq $((${RAY_STOP_GRACE:-10} * 4))); do
      [[ -z $(alive_pids $pids) ]] && break
      sleep 0.25
    done
    alive=$(alive_pids $pids)
    if [[ -n $alive ]]; then  # SIGKILL is not instant: the ports are free once they are gone
      kill -KILL $alive 2>/dev/null || true
      for _ in $(seq 20); do [[ -z $(alive_pids $alive) ]] && break; sleep 0.25; done
    fi
    rm -f "$dir/sid"
    echo "Ray head stopped ($(echo $pids | wc -w) processes)"
    ;;
  status)
    no_options "$@"
    [[ -n $(head_pids) ]] || die "no head running from $dir (bash infra/ray-head.sh start)"
    ray status --address "127.0.0.1:$port"
    ;;
  token)
    no_options "$@"
    ensure_token
    ray get-auth-token 2>/dev/null
    echo
    ;;
  env)
    no_options "$@"
    [[ -f $dir/env ]] || die "no head started from $dir (bash infra/ray-head.sh start)"
    cat "$dir/env"
    ;;
  *)
    echo "ray-head: unknown command '$cmd' (valid: start, stop, status, token, env; --help)" >&2; exit 2
    ;;
esac
