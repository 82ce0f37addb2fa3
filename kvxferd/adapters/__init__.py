"""Adapters that connect serving engines to a kvxferd daemon through the engines' own plug-in interfaces."""
