"""Entry point: ``python train.py --config FILE.toml [--section.key value ...]``, or the same under torchrun.
The same as ``python -m outlier_titan.train`` (see outlier_titan/train.py)."""

if __name__ == "__main__":
    from outlier_titan.train import main

    main()
