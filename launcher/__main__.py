"""``python -m launcher`` is ``fleetrun``."""

from launcher.cli import main

if __name__ == "__main__":
    main()
