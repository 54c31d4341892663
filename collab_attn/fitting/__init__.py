"""After a conversion: the converted model measured and fitted against its original. The input statistics of the
original's attention layers over calibration texts (``calibration``: what an activation-aware ``reparametrize``
takes), the checks every fit shares (``checks``), each converted layer fitted to the original's (``layer_fit``:
``fit_to_original``), all of them together to its output (``end_to_end``: ``fit_end_to_end``), each layer's share
of the distance (``sensitivity``: ``layer_sensitivity``) and the cache's sizes chosen by measurement
(``allocation``: ``allocate_cache``). Above ``collab_attn.models``, which never imports it."""
