"""Adapters that let serving engines use kvxferd through their own transfer interfaces.

Each engine gets its own subpackage, imported only by that engine's plugin mechanism, so
importing kvxferd never imports an engine.
"""
