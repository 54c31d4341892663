import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from matplotlib.figure import Figure

from collab_attn.analysis.energy import KINDS, cumulative_energy, layer_spectra, rank_for_energy

ROOT = Path(__file__).resolve().parents[1]


def test_cumulative_energy_of_known_singular_values():
    matrix = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    torch.testing.assert_close(cumulative_energy(matrix), torch.tensor([9 / 14, 13 / 14, 1.0, 1.0]))
    assert rank_for_energy(cumulative_energy(matrix), 0.9) == 2
    assert rank_for_energy(cumulative_energy(matrix), 13 / 14) == 2
    assert rank_for_energy(cumulative_energy(matrix), 0.99) == 3


def test_heads_sharing_a_subspace_concentrate_the_products():
    """Query directions that meet no key do not count: the products live in the shared 4-d query subspace."""
    g = torch.Generator().manual_seed(0)
    heads, head_dim, d_in, shared = 6, 8, 48, 4
    basis = torch.randn(shared, d_in, generator=g)
    w_query = torch.randn(heads, head_dim, d_in, generator=g)
    w_query[:, :4] = torch.randn(heads, 4, shared, generator=g) @ basis  # rows that meet a key: shared subspace
    w_key = torch.randn(heads, head_dim, d_in, generator=g)
    w_key[:, 4:] = 0  # rows 4..7 of each head's query meet no key
    spectra = layer_spectra(w_query, w_key)
    assert rank_for_energy(spectra["query"], 0.99) > 20
    assert rank_for_energy(spectra["products"], 0.999) == shared


def test_script_writes_plot_and_tables_for_minilm(tmp_path, monkeypatch):
    """The table's rows and the plot saved as energy.png (the figure caught as it is saved): one panel per layer with
    its three cumulative-energy curves against the number of components, the curves the table's ``k@`` columns
    are read from."""
    spec = importlib.util.spec_from_file_location("energy_script", ROOT / "scripts" / "energy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="energy", overrides=[f"output_dir={tmp_path / 'energy'}"])
    saved, computed = [], []
    savefig, model_spectra = Figure.savefig, script.model_spectra

    def save(fig, path, **kwargs):
        saved.append((fig, path))
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    monkeypatch.setattr(script, "model_spectra", lambda model: computed.append(model_spectra(model)) or computed[-1])
    rows = script.run(cfg)
    assert len(rows) == 6 * 3 and all(1 <= row["k@0.9"] <= row["k@0.99"] <= 384 for row in rows)
    assert {p.name for p in (tmp_path / "energy").iterdir()} == {"energy.png", "energy.csv", "energy.md"}
    ((fig, path),), (spectra,) = saved, computed
    assert Path(path).name == "energy.png"
    assert fig.get_suptitle() == "minilm: energy captured by the top-k components"
    assert len(fig.axes) == len(spectra) == 6
    labels = ["stacked queries Wq", "stacked keys Wk", "head products Wq_h^T Wk_h"]
    for index, (ax, (name, curves)) in enumerate(zip(fig.axes, spectra)):
        assert name == f"encoder.layer.{index}.attention.self" and ax.get_title() == f"layer.{index}"
        assert ax.get_xlabel() == "principal components"
        assert [line.get_label() for line in ax.get_lines()] == labels
        for line, kind, row in zip(ax.get_lines(), KINDS, rows[3 * index: 3 * index + 3], strict=True):
            energy = curves[kind].numpy()
            assert np.array_equal(line.get_xdata(), np.arange(1, len(energy) + 1))
            assert np.array_equal(line.get_ydata(), energy) and energy[-1] == pytest.approx(1)
            assert (row["layer"], row["kind"], row["dimension"]) == (name, kind, len(energy))
            for threshold in cfg.thresholds:  # the fewest components whose point on the curve reaches it
                assert row[f"k@{threshold:g}"] == 1 + int((energy < np.float32(threshold - 1e-9)).sum())
    assert fig.axes[0].get_ylabel() == "fraction of energy"
    assert [text.get_text() for text in fig.axes[0].get_legend().get_texts()] == labels
    with pytest.raises(ValueError, match="not empty"):
        script.run(cfg)
