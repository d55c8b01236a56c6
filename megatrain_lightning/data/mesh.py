"""Names of the MeSH "Chemicals and Drugs" [D] tree categories (second level, e.g. ``D02``).

From the U.S. National Library of Medicine's Medical Subject Headings (public domain), current
descriptors: the tree numbers ``D07``, ``D11``, ``D14``-``D19``, ``D21``, ``D22`` and ``D24`` are no
longer in use. The drug dictionary of ``drug-named-entity-recognition`` gives tree numbers such as
``D02.455.426.559.389.657.410.595.176`` (Aspirin) but not these names.
"""

from __future__ import annotations

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
