#!/usr/bin/env bash
# Make sure a headless Chromium and its WebDriver are installed (Debian: chromium +
# chromium-driver), for the dashboard's browser tests. Installs them with apt-get when missing
# (as root, or through passwordless sudo). Prints the two paths; exits non-zero with the reason
# when they are missing and cannot be installed.
set -euo pipefail

have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }

if ! have; then
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=""
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "chromium.sh: chromium/chromedriver missing and not root (no passwordless sudo) to apt-get them" >&2
        exit 3
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "chromium.sh: chromium/chromedriver missing and no apt-get on this system; install them by hand" >&2
        exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >&2
    $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2
fi

if ! have; then
    echo "chromium.sh: apt-get ran but chromium/chromedriver are still not on PATH" >&2
    exit 4
fi
echo "chromium=$(command -v chromium)"
echo "chromedriver=$(command -v chromedriver)"
