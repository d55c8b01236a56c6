"""Biomedical nomenclature offline: instruction pairs from a drug dictionary (MeSH) and ICD-10-CM.

Sources (both small pure-Python PyPI packages):

* ``drug-named-entity-recognition==2.0.9`` (MIT; DrugBank open data, MeSH, MedlinePlus): 20,070 drugs,
  name variants and synonyms, MeSH tree numbers. Its data file is a pickle, which can run code when
  loaded: it is read only from the installed package's own directory, never from a path a user gives.
* ``simple-icd-10-cm==1.5.0`` (public-domain CMS data), read through its own API: codes and descriptions.

Question kinds (``doc["kind"]``), all deterministic:

* ``mesh_category``: "What is the MeSH category of Aspirin?" -> "Organic Chemicals" (several categories
  are joined with ``"; "`` in code order, the question then says "categories").
* ``mesh_class``: "Name a broader MeSH concept that includes Acetaminophen." -> "Acetanilides" (the
  deepest ancestor tree number that is itself a drug of the dictionary).
* ``synonym``: "Give a synonym of Metformin." -> the first, alphabetically, of its other names (brand names
  included; inverted forms such as "hcl, metformin" left out).
* ``icd10cm``: "What does ICD-10-CM code E11.9 describe?" -> "Type 2 diabetes mellitus without complications".
"""

from __future__ import annotations

import bz2
import functools
import pickle
from collections import defaultdict

from .package_files import package_dir

DRUG_PIP = "drug-named-entity-recognition==2.0.9"
ICD_PIP = "simple-icd-10-cm==1.5.0"
DRUG_KINDS = ("mesh_category", "mesh_class", "synonym")
KINDS = DRUG_KINDS + ("icd10cm",)
# Names of the MeSH "Chemicals and Drugs" [D] tree categories (second level, e.g. ``D02``), from the U.S. National
# Library of Medicine's Medical Subject Headings (public domain), current descriptors: ``D07``, ``D11``,
# ``D14``-``D19``, ``D21``, ``D22`` and ``D24`` are no longer in use. The drug dictionary gives tree numbers such as
# ``D02.455.426.559.389.657.410.595.176`` (Aspirin) but not these names.
MESH_D_CATEGORIES = {
    "D01": "Inorganic Chemicals",
    "D02": "Organic Chemicals",
    "D03": "Heterocyclic Compounds",
    "D04": "Polycyclic Compounds",
    "D05": "Macromolecular Substances",
    "D06": "Hormones, Hormone Substitutes, and Hormone Antagonists",
    "D08": "Enzymes and Coenzymes",
    "D09": "Carbohydrates",
    "D10": "Lipids",
    "D12": "Amino Acids, Peptides, and Proteins",
    "D13": "Nucleic Acids, Nucleotides, and Nucleosides",
    "D20": "Complex Mixtures",
    "D23": "Biological Factors",
    "D25": "Biomedical and Dental Materials",
    "D26": "Pharmaceutical Preparations",
    "D27": "Chemical Actions and Uses",
}


def mesh_categories(tree_numbers: list[str]) -> list[str]:
    """Category names of MeSH tree numbers, distinct, in category-code order (unknown prefixes dropped).

    >>> mesh_categories(["D27.505.954.411", "D02.455.426"])
    ['Organic Chemicals', 'Chemical Actions and Uses']
    """
    codes = sorted({t.split(".")[0] for t in tree_numbers})
    return [MESH_D_CATEGORIES[c] for c in codes if c in MESH_D_CATEGORIES]


@functools.lru_cache(maxsize=1)
def drug_dictionary() -> dict:
    """The drug dictionary shipped in the installed ``drug_named_entity_recognition`` package.

    Keys: ``drug_canonical_to_data`` (canonical lower-case name -> ``{"name", "mesh_id", "mesh_tree",
    "synonyms", ...}``), ``drug_variant_to_canonical`` (variant -> list of canonical names),
    ``drug_variant_to_variant_data``. A bz2 pickle from the package directory only (module docstring). Cached;
    about 0.3 s.

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install drug-named-entity-recognition==2.0.9``).
        FileNotFoundError: the package lacks ``drug_ner_dictionary.pkl.bz2``.
    """
    path = package_dir("drug_named_entity_recognition", DRUG_PIP) / "drug_ner_dictionary.pkl.bz2"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package; reinstall {DRUG_PIP}.")
    with bz2.open(path, "rb") as f:
        return pickle.load(f)  # trusted: the installed package's own file, see the docstring


def _nearest_class(trees: list[str], tree_to_name: dict[str, str], name: str) -> str | None:
    best: tuple[int, str] | None = None
    for t in sorted(trees):
        parts = t.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = tree_to_name.get(".".join(parts[:i]))
            if parent is not None and parent != name:
                if best is None or i > best[0]:
                    best = (i, parent)
                break
    return best[1] if best else None


def _synonym(canonical: str, data: dict, variants: dict[str, list[str]]) -> str | None:
    names = set(data.get("synonyms") or []) | set(variants.get(canonical, []))
    names = sorted(n for n in names if n.lower() != canonical and n.lower() != data["name"].lower() and ", " not in n)
    return names[0] if names else None


def drug_pairs(kinds: tuple[str, ...] = DRUG_KINDS) -> list[dict]:
    """Instruction pairs about drugs: ``[{"id": "drug/<name>/<kind>", "prompt", "response", "group": "drug/<name>",
    "kind"}]``, drugs in alphabetical order of their canonical name, kinds in ``DRUG_KINDS`` order.

    Raises:
        ModuleNotFoundError / FileNotFoundError: see :func:`drug_dictionary`.
    """
    d = drug_dictionary()
    drugs = d["drug_canonical_to_data"]
    variants: dict[str, list[str]] = defaultdict(list)
    for variant, canonicals in d["drug_variant_to_canonical"].items():
        for c in canonicals:
            variants[c].append(variant)
    tree_to_name = {t: v["name"] for v in drugs.values() if "name" in v for t in v.get("mesh_tree") or []}
    out = []
    for canonical in sorted(drugs):
        data = drugs[canonical]
        name = data.get("name")
        if not name:
            continue
        trees = data.get("mesh_tree") or []
        answers = {}
        cats = mesh_categories(trees)
        if cats:
            q = "categories" if len(cats) > 1 else "category"
            answers["mesh_category"] = (f"What {'are' if len(cats) > 1 else 'is'} the MeSH {q} of {name}?", "; ".join(cats))
        parent = _nearest_class(trees, tree_to_name, name)
        if parent:
            answers["mesh_class"] = (f"Name a broader MeSH concept that includes {name}.", parent)
        syn = _synonym(canonical, data, variants)
        if syn:
            answers["synonym"] = (f"Give a synonym of {name}.", syn)
        for kind in kinds:
            if kind in answers:
                prompt, response = answers[kind]
                out.append({"id": f"drug/{canonical}/{kind}", "prompt": prompt, "response": response,
                            "group": f"drug/{canonical}", "kind": kind})
    return out


def icd10cm_pairs(seven_character: bool = False) -> list[dict]:
    """``[{"id": "icd10cm/<code>", "prompt": "What does ICD-10-CM code <code> describe?", "response": <description>,
    "group": "icd10cm/<category>", "kind": "icd10cm"}]`` in tabular order, categories and subcategories only
    (chapters and blocks left out). 46,881 codes; with ``seven_character`` also the 51,305 codes with a 7th
    character extension (e.g. ``S52.501A``), whose descriptions repeat the parent's with an encounter suffix.

    Raises:
        ModuleNotFoundError: ``simple-icd-10-cm`` is not installed.
    """
    package_dir("simple_icd_10_cm", ICD_PIP)  # a clear error before the import
    import simple_icd_10_cm as cm  # parses its bundled XML once, about 1.5 s

    out, seen = [], set()
    for code in cm.get_all_codes(with_dots=True):
        if code in seen or not cm.is_category_or_subcategory(code):
            continue  # 78 codes (e.g. B10) are listed twice, as a block and as a category
        seen.add(code)
        if not seven_character and cm.is_extended_subcategory(code):
            continue
        out.append({"id": f"icd10cm/{code}", "prompt": f"What does ICD-10-CM code {code} describe?",
                    "response": cm.get_description(code), "group": f"icd10cm/{code[:3]}", "kind": "icd10cm"})
    return out


def biomedical_pairs(kinds: tuple[str, ...] | list[str] | None = None, icd_seven_character: bool = False) -> list[dict]:
    """Biomedical instruction documents: drug pairs then ICD-10-CM pairs (see the module docstring).

    Args:
        kinds: subset of ``KINDS`` (``None``: all).
        icd_seven_character: include ICD-10-CM codes with a 7th-character extension.

    Returns:
        ``[{"id", "prompt", "response", "group", "kind"}]``, deterministic order. 76,557 documents with
        all kinds (8,749 mesh_category, 7,162 mesh_class, 13,765 synonym, 46,881 icd10cm).

    Raises:
        ValueError: an unknown kind.
        ModuleNotFoundError: a needed package is not installed.
    """
    kinds = tuple(kinds) if kinds is not None else KINDS
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"Unknown biomedical kinds {sorted(unknown)}; choose from {KINDS}.")
    docs = []
    drug_kinds = tuple(k for k in DRUG_KINDS if k in kinds)
    if drug_kinds:
        docs += drug_pairs(drug_kinds)
    if "icd10cm" in kinds:
        docs += icd10cm_pairs(icd_seven_character)
    return docs
