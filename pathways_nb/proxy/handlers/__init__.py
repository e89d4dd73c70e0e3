"""Request handlers; importing this package registers them with ``dispatch``."""

from pathways_nb.proxy.handlers import arrays, programs, session_info

__all__ = ["arrays", "programs", "session_info"]
