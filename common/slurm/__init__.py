"""Slurm: the sites' profiles (partitions, GPUs, module lines) and the sbatch templates rendered for them.

- :mod:`.sites`: site profiles, loaded and checked (labs read them too).
- :mod:`.jobs`: a template's job block, ``--set`` values, the request resolved against a site and
  checked (one line when the site cannot run it), and the commented ``#SBATCH`` lines.
- :mod:`.rendering`: the Jinja2 rendering with the shared preamble, every template for every site
  (``--all-sites``), and the renderings committed beside their templates (``scripts/render_sbatch.py``).

None of them imports torch.
"""
