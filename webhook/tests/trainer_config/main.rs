//! The trainer's own config through the webhook's review (issue 27): coupled settings, and
//! every pod of a job. One test binary (each costs CI a link).

mod coupled;
mod flag_maps;
mod jobs;
mod provenance;
