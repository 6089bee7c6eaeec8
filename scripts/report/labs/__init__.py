"""Lab-specific report sections: one module per lab, each registering with ``@register_section(lab)``.

Every module in this folder is imported when a report is built, so adding ``lab02.py`` here is all a
lab needs to do for its section to appear whenever its records are in the results folder.
"""
