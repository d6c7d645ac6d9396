#!/usr/bin/env bash
# deploy/netns/netns.sh - hosts on one machine: N network namespaces joined by a bridge in
# a "switch" namespace of their own, with a link profile (rate, delay, loss) per host link.
# Nothing touches the root namespace's network: no interface, address or route is added
# there, and the hosts have no route beyond their own /24.
#
# Sourced (the functions below; deploy/netns/cluster.sh, demo and tests build on them):
#   nn_check                 0 if namespaces can be made here, else 1 with the reason in
#                            NN_WHY (not root, no CAP_NET_ADMIN, no ip/tc)
#   nn_up N                  a run of N hosts: NN_PREFIX (unique per run), host i is the
#                            namespace "$(nn_ns i)" with eth0 = "$(nn_addr i)"/24; installs
#                            an EXIT/INT/TERM trap that tears the run down (nn_down)
#   nn_link_profile I NAME   applies profile NAME to host I's link, both directions
#   nn_link_set I RATE D L   host I's link at RATE (tbf, e.g. 20mbit; - none), D us delay
#                            and loss L per direction; again at any time (link flaps)
#   nn_exec I CMD...         runs CMD in host I (ip netns exec)
#   nn_path_delay_us A B     one-way delay from host A to host B that the relay must add
#                            (0 when netem does it), and nn_path_loss A B its stall rate
#   nn_describe              one line per host: namespace, address, profile
#   nn_down                  kills every process left in the run's namespaces (by pid) and
#                            deletes them; idempotent
# Run:
#   netns.sh check | netem | profiles | list
#   netns.sh cleanup [--all | PREFIX]   removes leftovers: by default the runs whose creating
#                                       process is gone; --all every run; PREFIX those runs
#   netns.sh up N [PROFILE] [-- CMD...] N hosts with PROFILE; runs CMD (env NN_PREFIX,
#                                       NN_ADDRS) or waits for Ctrl-C; then tears down
#
# Latency and loss: netem when the kernel has it (probed at run time in a scratch
# namespace), else the relay deploy/netns/moerpc-relay (see README.md). NN_LATENCY=relay
# forces the relay; NN_LATENCY=netem fails where netem is missing. NN_LAT_MECH says which
# is used: netem | relay.

NN_BASE=mrn                      # every namespace of every run starts with "mrn-"
NN_PREFIX=
NN_RUN=
NN_N=0
NN_WHY=
NN_LAT_MECH=
NN_LINK_PROFILE=()
NN_LINK_DELAY_US=()
NN_LINK_LOSS=()

# name  rate  delay per link direction (us)  loss per link direction  (host-to-host one-way
# delay = both links' delays; loss = both links' losses, to first order)
nn__profiles() {
  cat <<'EOF'
none    -       0     0       no shaping: the bare veth pair
25gbe   25gbit  25    0       25 Gbit/s, 0.05 ms one-way host to host
10gbe   10gbit  50    0       10 Gbit/s, 0.1 ms one-way host to host
1gbe    1gbit   100   0       1 Gbit/s, 0.2 ms one-way host to host
wan     1gbit   2500  0       1 Gbit/s, 5 ms one-way host to host
lossy   1gbit   250   0.005   1 Gbit/s, 0.5 ms one-way, 1% loss host to host
EOF
}

nn__die() { echo "netns: $*" >&2; return 1; }

nn_check() {
  NN_WHY=
  local t
  for t in ip tc; do
    command -v "$t" >/dev/null || { NN_WHY="'$t' is not installed (iproute2)"; return 1; }
  done
  local probe="$NN_BASE-probe-$$-$RANDOM" out
  if ! out=$(ip netns add "$probe" 2>&1); then
    NN_WHY="cannot create a network namespace (ip netns add: ${out:-failed}); this needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN"
    [ "$(id -u)" -ne 0 ] && NN_WHY="$NN_WHY; running as uid $(id -u), not root"
    return 1
  fi
  if ! out=$(ip netns exec "$probe" ip link add nnprobe type bridge 2>&1); then
    ip netns del "$probe" 2>/dev/null
    NN_WHY="cannot create a bridge in a namespace: $out"
    return 1
  fi
  ip netns del "$probe"
  return 0
}

# Whether this kernel has netem: tried in a scratch namespace, never on a real interface.
nn_netem_available() {
  local probe="$NN_BASE-probe-$$-$RANDOM" rc=1
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms >/dev/null 2>&1 && rc=0
  ip netns del "$probe"
  return $rc
}

nn__pick_mech() {
  case "${NN_LATENCY:-auto}" in
    relay) NN_LAT_MECH=relay ;;
    netem) nn_netem_available || { nn__die "NN_LATENCY=netem but this kernel has no sch_netem"; return 1; }
           NN_LAT_MECH=netem ;;
    auto) if nn_netem_available; then NN_LAT_MECH=netem; else NN_LAT_MECH=relay; fi ;;
    *) nn__die "NN_LATENCY='$NN_LATENCY': expected auto, netem or relay"; return 1 ;;
  esac
}

nn_ns() { echo "$NN_PREFIX-h$1"; }
nn_addr() { echo "10.77.$NN_RUN.$(($1 + 1))"; }
nn_switch() { echo "$NN_PREFIX-sw"; }
nn_exec() { local i=$1; shift; ip netns exec "$(nn_ns "$i")" "$@"; }

nn__on_signal() { nn_down; trap - EXIT; exit "$1"; }

nn_up() {
  local n=$1 i sw
  [ -n "$NN_PREFIX" ] && { nn__die "nn_up: a run ($NN_PREFIX) is already up"; return 1; }
  if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 200 ]; then
    nn__die "nn_up: host count '$n': expected 1..200"; return 1
  fi
  nn_check || { nn__die "$NN_WHY"; return 1; }
  nn__pick_mech || return 1
  # Unique per run: the creating pid (nn_cleanup uses it to find orphans) and a random tag.
  NN_PREFIX=$(printf '%s-%d-%04x' "$NN_BASE" "$$" "$((RANDOM))")
  NN_RUN=$(( ($$ + RANDOM) % 254 + 1 ))
  NN_N=$n
  trap 'nn_down' EXIT
  trap 'nn__on_signal 130' INT
  trap 'nn__on_signal 143' TERM
  sw=$(nn_switch)
  ip netns add "$sw" || { nn_down; return 1; }
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge || { nn_down; return 1; }
  ip -n "$sw" link set br0 up
  for ((i = 0; i < n; i++)); do
    local h
    h=$(nn_ns "$i")
    # The veth pair is made inside the switch namespace with its peer put straight into the
    # host namespace: the root namespace never sees either end.
    if ! { ip netns add "$h" &&
           ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$h" &&
           ip -n "$sw" link set "p$i" master br0 up &&
           ip -n "$h" addr add "$(nn_addr "$i")/24" dev eth0 &&
           ip -n "$h" link set eth0 up &&
           ip -n "$h" link set lo up; }; then
      nn__die "nn_up: could not set up host $i ($h)"; nn_down; return 1
    fi
    NN_LINK_PROFILE[i]=none; NN_LINK_DELAY_US[i]=0; NN_LINK_LOSS[i]=0
  done
}

# Applies profile NAME to host i's link: rate on both directions (tbf on the host's eth0
# and on its switch port), delay and loss by netem on both when the kernel has it, else
# recorded for the relay (nn_path_delay_us).
nn_link_profile() {
  local i=$1 name=$2 line rate d loss
  line=$(nn__profiles | awk -v n="$name" '$1 == n')
  [ -n "$line" ] || { nn__die "unknown profile '$name' (netns.sh profiles)"; return 1; }
  read -r _ rate d loss _ <<<"$line"
  nn_link_set "$i" "$rate" "$d" "$loss" || return 1
  NN_LINK_PROFILE[i]=$name
}

# Sets host i's link to RATE (tbf rate, e.g. 20mbit or 1gbit; - for none), a one-way delay
# of D us and a loss probability L (0..1) per link direction, as a profile does; may be
# called again at any time (the chaos soak flaps links with it). The profile name becomes
# "custom" until nn_link_profile names one again.
nn_link_set() {
  local i=$1 rate=$2 d=$3 loss=$4
  local dev ns
  for side in host switch; do
    if [ $side = host ]; then ns=$(nn_ns "$i"); dev=eth0; else ns=$(nn_switch); dev="p$i"; fi
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    [ "$rate" = - ] && [ "$d" = 0 ] && continue
    local parent="root" burst
    if [ "$NN_LAT_MECH" = netem ] && { [ "$d" != 0 ] || [ "$loss" != 0 ]; }; then
      local lossarg=()
      [ "$loss" != 0 ] && lossarg=(loss "$(awk -v l="$loss" 'BEGIN{printf "%g%%", l*100}')")
      ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "${d}us" \
          "${lossarg[@]}" limit 100000 || return 1
      parent="parent 1:"
    fi
    if [ "$rate" != - ]; then
      # Burst: 100 us of line rate, at least 64 KiB (one GSO segment must fit).
      burst=$(awk -v r="$rate" 'BEGIN{ m = 1e9; if (r ~ /mbit$/) m = 1e6; sub(/[gm]bit$/, "", r);
                                       b = r * m / 8 * 100e-6;
                                       if (b < 65536) b = 65536; printf "%d", b }')
      # shellcheck disable=SC2086 # parent is two words or one
      ip netns exec "$ns" tc qdisc add dev "$dev" $parent handle 2: tbf rate "$rate" \
          burst "$burst" latency 20ms || return 1
    fi
  done
  NN_LINK_PROFILE[i]=custom
  NN_LINK_DELAY_US[i]=$d
  NN_LINK_LOSS[i]=$loss
}

# One-way delay (us) and stall probability the relay must add between hosts a and b: the
# sum over both links, or 0 when netem already delays the packets.
nn_path_delay_us() {
  [ "$NN_LAT_MECH" = netem ] && { echo 0; return; }
  echo $(( ${NN_LINK_DELAY_US[$1]:-0} + ${NN_LINK_DELAY_US[$2]:-0} ))
}
nn_path_loss() {
  [ "$NN_LAT_MECH" = netem ] && { echo 0; return; }
  awk -v a="${NN_LINK_LOSS[$1]:-0}" -v b="${NN_LINK_LOSS[$2]:-0}" 'BEGIN{printf "%g", a + b}'
}
# What produces the delay between hosts a and b, for figures: "netem", "relay" or "none".
nn_path_mech() {
  if [ "${NN_LINK_DELAY_US[$1]:-0}" = 0 ] && [ "${NN_LINK_DELAY_US[$2]:-0}" = 0 ] &&
     [ "${NN_LINK_LOSS[$1]:-0}" = 0 ] && [ "${NN_LINK_LOSS[$2]:-0}" = 0 ]; then
    echo none
  else
    echo "$NN_LAT_MECH"
  fi
}

# One line per host: namespace, address, profile (for logs and figures).
nn_describe() {
  local i
  for ((i = 0; i < NN_N; i++)); do
    printf '    host %d  %-22s %-14s profile %s\n' "$i" "$(nn_ns "$i")" "$(nn_addr "$i")" \
        "${NN_LINK_PROFILE[$i]}"
  done
}

# Kills the processes inside a namespace (only those: ip netns pids lists by namespace)
# and deletes it.
nn__del_ns() {
  local ns=$1 pids p
  pids=$(ip netns pids "$ns" 2>/dev/null) || true
  for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
  for p in $pids; do
    local t
    for t in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
  done
  ip netns del "$ns" 2>/dev/null || true
}

nn_down() {
  [ -n "$NN_PREFIX" ] || return 0
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ "$ns" == "$NN_PREFIX"-* ]] && nn__del_ns "$ns"
  done
  NN_PREFIX=
  NN_N=0
}

# Removes leftovers: runs whose creating process is gone (default), every run (--all), or
# the runs starting with PREFIX. Prints one line per namespace removed.
nn_cleanup() {
  local what=${1:-orphans} ns pid n=0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ "$ns" == "$NN_BASE"-* ]] || continue
    case "$what" in
      orphans)
        pid=$(echo "$ns" | sed -n "s/^$NN_BASE-\([0-9][0-9]*\)-.*/\1/p")
        [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && continue ;;
      --all) ;;
      *) [[ "$ns" == "$what"* ]] || continue ;;
    esac
    nn__del_ns "$ns"
    echo "netns: removed $ns"
    n=$((n + 1))
  done
  echo "netns: cleanup removed $n namespaces"
}

nn__main() {
  local cmd=${1:-help}
  shift || true
  case "$cmd" in
    check) if nn_check; then echo "netns: ok (namespaces, veth, bridge)"; else echo "netns: $NN_WHY" >&2; exit 1; fi ;;
    netem) if nn_netem_available; then echo "netem: available"; else echo "netem: not in this kernel (the relay is used)"; exit 1; fi ;;
    profiles) echo "name    rate    delay_us_per_link  loss_per_link  what"; nn__profiles ;;
    list) ip netns list | awk '{print $1}' | grep "^$NN_BASE-" || echo "netns: no runs" ;;
    cleanup) nn_cleanup "$@" ;;
    up)
      local n=${1:-} prof=none
      [ -n "$n" ] || { echo "usage: netns.sh up N [PROFILE] [-- CMD...]" >&2; exit 2; }
      shift
      if [ $# -gt 0 ] && [ "$1" != -- ]; then prof=$1; shift; fi
      [ "${1:-}" = -- ] && shift
      nn_up "$n" || exit 1
      local i addrs=""
      for ((i = 0; i < n; i++)); do nn_link_profile "$i" "$prof" || exit 1; addrs+="$(nn_addr "$i") "; done
      echo "netns: run $NN_PREFIX: $n hosts, latency by $NN_LAT_MECH (ip netns exec NAMESPACE CMD)"
      nn_describe
      if [ $# -gt 0 ]; then
        NN_PREFIX=$NN_PREFIX NN_ADDRS=$addrs "$@"
        exit $?
      fi
      echo "netns: Ctrl-C tears it down"
      while :; do sleep 3600; done ;;
    help|-h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
    *) echo "netns.sh: unknown command '$cmd' (see --help)" >&2; exit 2 ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -u
  nn__main "$@"
fi
