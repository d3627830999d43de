//! The daemon's facts as a person reads them: the status document in words, rates and ETAs
//! from successive documents, the journal's rows and their filters. Shared by the CLI
//! (`status`, `status --watch`, `journal`) and the page (`meshfs ui`), so the two say the same
//! things the same way. Pure: it formats what it is given and reads no lock, file or clock
//! except where a function says so.

pub mod journal;
pub mod on_demand;
pub mod rates;
pub mod status;
