//! Sequences decoded with a cap on their length, for the lists a peer controls.
//!
//! A list over its cap is refused as soon as its declared count is read, before any element
//! is decoded or any memory is reserved for it (postcard states the count when the input has
//! at least that many bytes left; with fewer, the input runs out first). Otherwise it is
//! refused at element `cap + 1`. Memory reserved up front is at most a small fixed number of
//! elements, whatever a peer declares. Serializing is untouched: the wire encoding of a list
//! within its cap is the plain `Vec<T>` one.
//!
//! The clear error for people is [`crate::LimitError`], checked after decoding
//! (`decode_payload`); this early refusal only keeps memory bounded on the way there, and
//! postcard reports it as a bare deserialization error.

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// Elements reserved up front at most, so a declared count costs nothing before the elements
/// arrive.
const RESERVE: usize = 256;

/// Deserializes a `Vec<T>` of at most `CAP` elements (`#[serde(deserialize_with)]`).
pub(crate) fn vec<'de, D, T, const CAP: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(AtMost::<T, CAP>(PhantomData))
}

struct AtMost<T, const CAP: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const CAP: usize> Visitor<'de> for AtMost<T, CAP> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a list of at most {CAP} elements")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let declared = seq.size_hint();
        if let Some(n) = declared.filter(|&n| n > CAP) {
            return Err(A::Error::invalid_length(n, &self));
        }
        let mut out = Vec::with_capacity(declared.unwrap_or(0).min(RESERVE));
        while let Some(x) = seq.next_element()? {
            if out.len() == CAP {
                return Err(A::Error::invalid_length(CAP + 1, &self));
            }
            out.push(x);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Three(#[serde(deserialize_with = "vec::<_, _, 3>")] Vec<u32>);

    #[test]
    fn a_list_within_its_cap_decodes_as_a_plain_vec() {
        let bytes = postcard::to_allocvec(&vec![1u32, 2, 3]).unwrap();
        assert_eq!(
            postcard::from_bytes::<Three>(&bytes),
            Ok(Three(vec![1, 2, 3]))
        );
        let empty = postcard::to_allocvec(&Vec::<u32>::new()).unwrap();
        assert_eq!(postcard::from_bytes::<Three>(&empty), Ok(Three(vec![])));
    }

    #[test]
    fn a_declared_count_over_the_cap_is_refused_before_any_element() {
        // Count 4, then nothing: refused on the count, not for want of elements.
        assert!(postcard::from_bytes::<Three>(&[4]).is_err());
        let bytes = postcard::to_allocvec(&vec![1u32, 2, 3, 4]).unwrap();
        assert!(postcard::from_bytes::<Three>(&bytes).is_err());
    }

    #[test]
    fn a_format_without_a_count_is_refused_at_one_past_the_cap() {
        // A filtered iterator does not know its length, so the deserializer gives no count.
        let over = serde::de::value::SeqDeserializer::<_, serde::de::value::Error>::new(
            [1u32, 2, 3, 4].into_iter().filter(|_| true),
        );
        assert!(vec::<_, u32, 3>(over).is_err());
        let at = serde::de::value::SeqDeserializer::<_, serde::de::value::Error>::new(
            [1u32, 2, 3].into_iter().filter(|_| true),
        );
        assert_eq!(vec::<_, u32, 3>(at), Ok(vec![1, 2, 3]));
    }
}
