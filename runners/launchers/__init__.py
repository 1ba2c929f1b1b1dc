"""Launchers: how a run is started under its lock, checked alive and cancelled on a target."""
