"""The sections of each lab, one module per lab registering with ``@register_section(lab)`` (how to write one:
``common/report/__init__.py``). Every module here is imported when a report is built. A module reads records only,
through ``ctx.runs``: it never imports the lab's scripts or torch; a name both need lives once in ``common``.
"""
