//! CRD types (`MemguardPolicy`, `MemoryProfile`), generated into `crds/` by `memguard crdgen`.
//! (To be built by the chart and CRD work, issue 6.)
