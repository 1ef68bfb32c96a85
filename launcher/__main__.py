"""``python -m launcher`` is ``fleetrun``."""

from launcher.prestart import main

if __name__ == "__main__":
    main()
