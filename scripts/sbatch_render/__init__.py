"""The pieces of ``scripts/render_sbatch.py``, one audience each.

- :mod:`common.sites` (not here: labs read it too): site profiles, loaded and checked.
- :mod:`.jobs`: a template's job block, ``--set`` values, the request resolved against a site and
  checked (one line when the site cannot run it), and the commented ``#SBATCH`` lines.
- :mod:`.rendering`: the Jinja2 rendering with the shared preamble, every template for every site
  (``--all-sites``), and the renderings committed beside their templates.

None of them imports torch.
"""
