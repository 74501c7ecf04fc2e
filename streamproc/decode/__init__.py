"""Decode, the second stage: a cut batch's records become rows of a staging slab, on threads or
processes, with the worker count sized to the load."""
