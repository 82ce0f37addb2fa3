"""Tools around the daemon: simulated engines, the byte oracle, ``kvxferd demo`` and
``kvxferd bench``.

Nothing in the daemon's runtime imports this package; it drives the daemon from outside,
as engines do, and checks every byte it moves against :mod:`kvxferd.tools.oracle`.
"""
