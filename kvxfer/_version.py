"""Version numbers: the package release and the side-channel protocol."""

__version__ = "0.1.0"
# Bumped on any incompatible change of a wire message; folded into the compat hash.
PROTOCOL_VERSION = 1
