"""Peer implementations we compare against (speculators), each in its own venv."""
