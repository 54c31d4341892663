"""The converted layers' old home, kept for the import paths of scripts and users: every name is now in
``collab_attn.kinds`` (one package per layer kind, ``collab_attn.kinds.converted`` for what they share)."""

from collab_attn.kinds import *  # noqa: F403
