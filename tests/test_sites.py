"""common/slurm/sites.py: site profiles loaded one by one or all together, link peaks, one-line errors.

The profiles of the repository and what the renderer does with them: tests/test_render_sbatch.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.errors import UserError
from common.slurm import sites
from common.slurm.sites import Link, find_site, load_site, load_sites, site_names

PROFILE = """\
name: lab
max_time: "1-00:00:00"
default_partitions: {cpu: cpu, gpu: gpu}
partitions:
  cpu: {cpus_per_node: 8}
  gpu:
    cpus_per_node: 32
    gpus_per_node: 4
    cpus_per_gpu: 8
    links:
%s
"""
LINKS = """\
      nvlink: {gb_per_s: 300, source: "NVIDIA A100 data sheet: 600 GB/s both directions"}
      infiniband: {gb_per_s: 25, source: "HDR InfiniBand, 200 Gb/s"}"""


def write_profile(folder: Path, links: str = LINKS, name: str = "lab") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text((PROFILE % links).replace("name: lab", f"name: {name}"))
    return path


def test_one_site_and_all_sites_with_their_link_peaks(tmp_path):
    write_profile(tmp_path)
    write_profile(tmp_path, links="      {}", name="plain")
    assert site_names(tmp_path) == ["lab", "plain"]
    every = load_sites(tmp_path)
    assert list(every) == ["lab", "plain"]
    gpu = find_site("lab", tmp_path).partitions["gpu"]
    assert gpu.links == load_site(tmp_path / "lab.yaml").partitions["gpu"].links == {
        "nvlink": Link("nvlink", 300.0, "gpu", "NVIDIA A100 data sheet: 600 GB/s both directions"),
        "infiniband": Link("infiniband", 25.0, "node", "HDR InfiniBand, 200 Gb/s"),
    }
    assert every["plain"].partitions["gpu"].links == {} and every["lab"].partitions["cpu"].links == {}
    assert every["lab"].as_dict()["partitions"]["gpu"]["links"]["nvlink"]["gb_per_s"] == 300.0  # templates see them


@pytest.mark.parametrize(("kind", "per"), [("nvlink", "gpu"), ("pcie", "gpu"), ("infiniband", "node"),
                                         ("slingshot", "node"), ("ethernet", "node")])
def test_each_link_kind_is_read_per_gpu_or_per_node_and_gpu_links_need_gpus(tmp_path, kind, per):
    """A GPU link's peak is per GPU and needs a partition with GPUs; a network's is per node, on any partition."""
    path = write_profile(tmp_path, links=f"      {kind}: {{gb_per_s: 10, source: x}}")
    assert load_site(path).partitions["gpu"].links == {kind: Link(kind, 10.0, per, "x")}
    on_cpus = f"cpu: {{cpus_per_node: 8, links: {{{kind}: {{gb_per_s: 10, source: x}}}}}}"
    path.write_text(path.read_text().replace("cpu: {cpus_per_node: 8}", on_cpus))
    if per == "gpu":
        with pytest.raises(UserError, match=rf"partitions\.cpu\.links: GPU links \({kind}\) on a partition without"):
            load_site(path)
    else:
        assert load_site(path).partitions["cpu"].links == {kind: Link(kind, 10.0, "node", "x")}


@pytest.mark.parametrize(
    ("links", "expected"),
    [
        ("      nvlink: 300", "partitions.gpu.links.nvlink must be a mapping: {gb_per_s: NUMBER, source: TEXT}"),
        ("      nvlink: {gb_per_s: 0, source: x}", "partitions.gpu.links.nvlink.gb_per_s must be a number > 0"),
        ("      nvlink: {gb_per_s: fast, source: x}", "partitions.gpu.links.nvlink.gb_per_s must be a number > 0"),
        ("      nvlink: {gb_per_s: 300}", "partitions.gpu.links.nvlink.source must say where the number comes from"),
        ("      nvlink: {gb_per_s: 300, source: x, unit: GB}", "links.nvlink: unknown key(s) unit"),
        ("      omnipath: {gb_per_s: 12, source: x}",
         "partitions.gpu.links.omnipath: unknown link kind (known: nvlink"),
        ("      - nvlink", "partitions.gpu.links must map link kinds to their peaks"),
    ],
)
def test_a_bad_link_peak_is_one_line_naming_file_and_field(tmp_path, links, expected):
    write_profile(tmp_path, links)
    with pytest.raises(UserError) as raised:
        load_sites(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'lab.yaml'}: ") and expected in message and "\n" not in message


def test_unknown_site_lists_the_known_ones(tmp_path):
    write_profile(tmp_path)
    with pytest.raises(UserError, match=r"unknown site 'nowhere' \(known sites: lab; add slurm/sites/nowhere\.yaml\)"):
        find_site("nowhere", tmp_path)


def test_a_profile_named_yml_is_one_line_asking_for_yaml(tmp_path):
    """Read as *.yaml only, a lab.yml would be missing from every site list without a word."""
    write_profile(tmp_path).rename(tmp_path / "lab.yml")
    for call in (lambda: site_names(tmp_path), lambda: load_sites(tmp_path), lambda: find_site("lab", tmp_path)):
        with pytest.raises(UserError, match=r"lab\.yml: a site profile's file name ends in \.yaml: rename it to "
                                            r"lab\.yaml$"):
            call()


def test_unknown_site_given_as_its_file_names_the_profile_to_give(tmp_path):
    write_profile(tmp_path)
    for given in ("lab.yaml", "slurm/sites/lab.yaml"):
        with pytest.raises(UserError, match=rf"^site '{given}': give the profile's name, 'lab', not its file$"):
            find_site(given, tmp_path)
    with pytest.raises(UserError,
                       match=r"unknown site 'other\.yaml' \(known sites: lab; add slurm/sites/other\.yaml\)"):
        find_site("other.yaml", tmp_path)


BASE = """\
name: lab
title: A lab cluster
max_time: "1-00:00:00"
account: null
reservation: null
default_partitions: {cpu: cpu, gpu: gpu}
partitions:
  cpu: {cpus_per_node: 8}
  gpu: {cpus_per_node: 32, gpus_per_node: 4, cpus_per_gpu: 8, description: GPU nodes}
"""


@pytest.mark.parametrize(("change", "value", "expected"), [
    (("reservation: null", "reservation: no"), None,
     "reservation must be text or null, got False (YAML reads yes/no/on/off/true/false as true or false"),
    (("account: null", "account: on"), None, "account must be text or null, got True"),
    (("account: null", "account: my project"), None, "account must be one word of letters, digits"),
    (("title: A lab cluster", "title: |\n  A lab cluster\n  (4x A100)"), None, "title must be one line"),
    (("description: GPU nodes}", "description: \"GPU nodes\\n64 cores\"}"), None,
     "partitions.gpu.description must be one line"),
    (("cpus_per_gpu: 8,", "cpus_per_gpu: 16,"), None,
     "partitions.gpu: cpus_per_gpu 16 x gpus_per_node 4 is 64 cores, more than cpus_per_node 32"),
    (("cpus_per_gpu: 8,", "cpus_per_gpu: 8, typed_gres: 'false',"), None,
     "partitions.gpu.typed_gres must be true or false, got 'false'"),
    (("account: null", "account: null\naccount_required: \"no\""), None, "account_required must be true or false"),
    (("title: A lab cluster", "title: A lab cluster\nsetup: [source a.sh]\nsetup: [source b.sh]"), None,
     "line 4: not valid YAML: 'setup' is given twice (first on line 3)"),
    (("  cpu: {cpus_per_node: 8}", "  cpu: {cpus_per_node: 8}\n  cpu: {cpus_per_node: 16}"), None,
     "line 9: not valid YAML: 'cpu' is given twice (first on line 8)"),
    (("  gpu: {", "  gpu a100: {"), None, "partitions.gpu a100 must be one word"),
    # node_local goes into NODE_LOCAL="${NODE_LOCAL:-...}" of Lab-08's job: "~" stays a folder named ~ there, and a
    # quote or an unmatched brace is a syntax error only when the job runs.
    (("account: null", "account: null\nnode_local: ~/scratch"), None,
     "node_local must be an absolute path or start with a variable"),
    (("account: null", "account: null\nnode_local: '/local/my\"dir'"), None, "node_local must not hold"),
    (("account: null", "account: null\nnode_local: '${LOCAL_SCRATCH:-/tmp'"), None, "node_local must not hold"),
])
def test_a_profile_value_a_script_would_misread_is_one_line_naming_the_field(tmp_path, change, value, expected):
    (tmp_path / "lab.yaml").write_text(BASE.replace(*change))
    with pytest.raises(UserError) as raised:
        load_sites(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'lab.yaml'}") and expected in message and "\n" not in message


def test_names_and_accounts_that_look_like_numbers_stay_as_written(tmp_path):
    """YAML 1.1 reads 012345 as the octal 5349 and 2024_05 as 202405: an #SBATCH line must carry what was typed."""
    (tmp_path / "lab.yaml").write_text(BASE.replace("account: null", "account: 012345")
                                       .replace("reservation: null", "reservation: 2024_05"))
    site = load_site(tmp_path / "lab.yaml")
    assert (site.account, site.reservation) == ("012345", "2024_05")
    (tmp_path / "lab.yaml").write_text(BASE.replace("account: null", "account: 4711"))
    assert load_site(tmp_path / "lab.yaml").account == "4711"


def test_a_site_name_that_is_not_one_word_is_refused(tmp_path):
    (tmp_path / "lab u.yaml").write_text(BASE.replace("name: lab", "name: lab u"))
    with pytest.raises(UserError, match=r"lab u\.yaml: name must be one word of letters, digits"):
        load_site(tmp_path / "lab u.yaml")


def test_the_readme_profile_format_shows_every_key_a_profile_may_have(tmp_path):
    """An instructor writes a profile from the format block of slurm/sites/README.md: it must name every key the
    reader accepts (and no other), and be a profile that loads as it stands."""
    readme = (Path(__file__).resolve().parents[1] / "slurm" / "sites" / "README.md").read_text()
    block = readme.split("\n## Profile format\n", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "lanta.yaml").write_text(block)
    assert load_site(tmp_path / "lanta.yaml").name == "lanta"
    assert set(re.findall(r"^(\w+):", block, re.M)) == sites._SITE_KEYS
    assert set(re.findall(r"^    (\w+):", block, re.M)) == sites._PARTITION_KEYS


def test_setup_lines_bash_reads_are_kept_as_written(tmp_path):
    """Each setup line is checked with bash -n on its own: a `|` block holding a whole `if` is one such line."""
    lines = ["module load cuda/12.4; module load py", "if true; then\n  module load x\nfi", "cat <<'EOF'\nx\nEOF"]
    setup = "".join(f"  - {line}\n" if "\n" not in line else "  - |-\n" + "".join(f"    {part}\n"
                                                                                for part in line.split("\n"))
                    for line in lines)
    (tmp_path / "lab.yaml").write_text(BASE + "setup:\n" + setup)
    assert load_site(tmp_path / "lab.yaml").setup == tuple(lines)


def test_an_editors_hidden_files_beside_the_profiles_are_not_profiles(tmp_path):
    """Emacs links .#lab.yaml to nowhere while a change to lab.yaml is unsaved: --list-sites and --all-sites failed on
    it ('cannot read it'), as they did on a hidden copy such as .lab.yaml, whose name is not its file's."""
    write_profile(tmp_path)
    (tmp_path / ".#lab.yaml").symlink_to("user@host.1234:1700000000")
    (tmp_path / ".lab.yaml").write_text((tmp_path / "lab.yaml").read_text())
    (tmp_path / ".#lab.yml").symlink_to("user@host.1234:1700000000")
    assert site_names(tmp_path) == ["lab"]
    assert list(load_sites(tmp_path)) == ["lab"]


@pytest.mark.parametrize("empty", ["", " ''", " null"])
def test_a_default_partition_left_empty_says_so_and_what_to_write(tmp_path, empty):
    """`cpu:` with nothing after it was 'default_partitions.cpu is None, which is not in partitions'."""
    (tmp_path / "lab.yaml").write_text(BASE.replace("default_partitions: {cpu: cpu, gpu: gpu}",
                                                    f"default_partitions:\n  cpu:{empty}\n  gpu: gpu"))
    with pytest.raises(UserError) as raised:
        load_sites(tmp_path)
    assert str(raised.value) == (f"{tmp_path / 'lab.yaml'}: default_partitions.cpu is empty: name the partition cpu "
                                 "jobs get (partitions: cpu, gpu; a cluster without CPU nodes names its GPU partition)")


def test_a_default_partition_that_is_not_a_partition_names_it(tmp_path):
    (tmp_path / "lab.yaml").write_text(BASE.replace("{cpu: cpu,", "{cpu: cpus,"))
    with pytest.raises(UserError, match=r"lab\.yaml: default_partitions\.cpu is 'cpus', which is not in partitions "
                                        r"\(cpu, gpu\)$"):
        load_sites(tmp_path)


def test_a_folder_named_like_a_profile_is_not_one(tmp_path):
    """A folder lab2.yaml was listed as a site yet 'unknown site' to --site lab2 (and --list-sites failed: 'cannot
    read it: Is a directory'); a folder old.yml was taken for a misnamed profile."""
    write_profile(tmp_path)
    (tmp_path / "lab2.yaml").mkdir()
    (tmp_path / "old.yml").mkdir()
    assert site_names(tmp_path) == ["lab"]
    assert list(load_sites(tmp_path)) == ["lab"]
    with pytest.raises(UserError, match=r"^unknown site 'lab2' \(known sites: lab; add slurm/sites/lab2\.yaml\)$"):
        find_site("lab2", tmp_path)
