"""One frozen, validated configuration tree: the root and its loading (:mod:`.loading`:
:class:`Config`, :func:`load_config`, exported here), the sections (:mod:`.sections`)."""

from streamproc.config.loading import Config, load_config

__all__ = ["Config", "load_config"]
