"""Lab-specific report sections: one module per lab, each registering with ``@register_section(lab)``.

Every module in this folder is imported when a report is built, so adding ``lab04.py`` here is all a
lab needs to do for its section to appear whenever its records are in the results folder. A module
reads records only (``ctx.runs``, and ``record`` for anything else): it must not import the lab's
scripts or torch. Names a lab's scripts and its section both need (Lab-03's precisions, say) live
once in ``common``.
"""
