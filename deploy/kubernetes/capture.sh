#!/bin/sh
# Sends the pod's outbound TCP on the chosen ports to herdguard's listener
# (iptables REDIRECT; IPv4, and IPv6 when asked), so that an app
# that knows nothing of herdguard goes through it. herdguard's own
# connections (by its user id, as Istio excludes uid 1337) and the excluded
# destinations are left alone. Run once per pod by an init container that
# has NET_ADMIN (and only that one); the rules live in the pod's network
# namespace, so every container of the pod is captured, herdguard's own
# traffic excepted.
#
# Settings (environment):
#   HERDGUARD_PORT   the listener's port, with `transparent = true` (15001)
#   HERDGUARD_UID    the user id herdguard runs as (1337)
#   CAPTURE_PORTS    destination ports captured, space separated (80 8080)
#   CAPTURE_EXCLUDE  destination CIDRs never captured, space separated
#                    (127.0.0.1/32: the pod talking to itself)
#   CAPTURE_CHAIN    the chain's name (HERDGUARD_OUTPUT)
#   CAPTURE_IPV6     1: capture IPv6 too (0). A redirected IPv6 connection
#                    arrives at [::1]: only a listener on [::] takes it,
#                    and that one is reachable from outside the pod too
#                    (keep unrouted = "refuse" or a NetworkPolicy there).
#                    Left at 0, IPv6 calls go out directly, uncaptured.
set -eu

port="${HERDGUARD_PORT:-15001}"
uid="${HERDGUARD_UID:-1337}"
ports="${CAPTURE_PORTS:-80 8080}"
exclude="${CAPTURE_EXCLUDE:-127.0.0.1/32}"
chain="${CAPTURE_CHAIN:-HERDGUARD_OUTPUT}"
ipv6="${CAPTURE_IPV6:-0}"

rules() {
    tables="$1"
    family="$2"
    # Again from scratch when run twice (a restarted init container).
    "$tables" -t nat -D OUTPUT -p tcp -j "$chain" 2>/dev/null || true
    "$tables" -t nat -F "$chain" 2>/dev/null || "$tables" -t nat -N "$chain"
    "$tables" -t nat -A "$chain" -m owner --uid-owner "$uid" -j RETURN
    for cidr in $exclude; do
        case "$cidr" in
            *:*) [ "$family" = 6 ] || continue ;;
            *) [ "$family" = 4 ] || continue ;;
        esac
        "$tables" -t nat -A "$chain" -d "$cidr" -j RETURN
    done
    for p in $ports; do
        "$tables" -t nat -A "$chain" -p tcp --dport "$p" -j REDIRECT --to-ports "$port"
    done
    "$tables" -t nat -A OUTPUT -p tcp -j "$chain"
}

rules iptables 4
if [ "$ipv6" = 1 ]; then
    rules ip6tables 6
fi
echo "herdguard capture: tcp ports $ports -> :$port (uid $uid and $exclude excluded)"
