#!/usr/bin/env bash
# System tools the test suite uses beyond Python and Rust, from Debian's packages (run as root, as CI does):
# chromium renders the HTML training report in a real browser (tests/e2e/test_observability.py); the multi-host tests
# (tests/netns/test_multihost.py) need iproute2 (namespaces, veth, tc), nftables (packet loss) and openssh-server/client
# (`ddlf up` over ssh), the Slurm tests (tests/slurm/) slurmctld, slurmd and munge, Spark's tests need a Java runtime, and valgrind checks the Rust kernels for out-of-bounds accesses (tests/unit/test_valgrind.py). Without root or
# apt-get it says what is missing and goes on; the tests that need a tool skip outside CI and fail inside it.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
# Spark (tests/e2e/test_spark.py) runs on a Java runtime.
command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
# Slurm for real (tests/slurm/): a controller and one slurmd per namespace host, authenticated by munge.
[ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
[ -x /usr/sbin/slurmd ] || missing+=(slurmd)
command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
[ -x /usr/sbin/munged ] || missing+=(munge)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system.sh: not root or no apt-get; please install: ${missing[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "== installing system packages: ${missing[*]}"
if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
