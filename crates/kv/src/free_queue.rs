//! The free-block queue: an intrusive doubly-linked list over block indices, in LRU order.
//!
//! Design: vLLM v1's `FreeKVCacheBlockQueue` (prev/next pointers inside each block, fake
//! head and tail nodes) rewritten in the mistral.rs style: two `u32` arrays indexed by block
//! id, with two sentinel indices past the last block standing in for the fake head and tail.
//! Sentinels remove every "is this the first/last element" branch, and the arrays make
//! removing a block from the middle O(1), which the prefix cache needs when it revives a
//! free block that still holds cached K/V.
//!
//! Order is the eviction order: the head is the least recently freed block and is the next
//! one handed out; freed blocks join the tail.

/// Marks a link of a block that is not in the queue.
const NOT_LINKED: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct FreeQueue {
    /// `next[i]` is the index after `i`; entries for blocks outside the queue are `NOT_LINKED`.
    next: Vec<u32>,
    /// `prev[i]` is the index before `i`; entries for blocks outside the queue are `NOT_LINKED`.
    prev: Vec<u32>,
    /// Number of real blocks (not sentinels) in the queue.
    len: u32,
    num_blocks: u32,
}

impl FreeQueue {
    /// The largest block count: two indices past the last block are the sentinels, and
    /// `u32::MAX` itself is `NOT_LINKED`.
    pub(crate) const NUM_BLOCKS_MAX: u32 = u32::MAX - 2;

    /// A queue holding every block, in id order, so that a fresh pool hands out 0, 1, 2, ….
    pub(crate) fn new_full(num_blocks: u32) -> Self {
        assert!(
            num_blocks <= Self::NUM_BLOCKS_MAX,
            "free queue: num_blocks {num_blocks} exceeds the limit {}",
            Self::NUM_BLOCKS_MAX
        );
        let head = num_blocks;
        let tail = num_blocks + 1;
        let num_slots = num_blocks as usize + 2;
        let mut next = vec![NOT_LINKED; num_slots];
        let mut prev = vec![NOT_LINKED; num_slots];
        // Chain head -> 0 -> 1 -> ... -> n-1 -> tail.
        let mut before = head;
        for index in 0..num_blocks {
            next[before as usize] = index;
            prev[index as usize] = before;
            before = index;
        }
        next[before as usize] = tail;
        prev[tail as usize] = before;
        FreeQueue {
            next,
            prev,
            len: num_blocks,
            num_blocks,
        }
    }

    #[inline]
    fn head(&self) -> u32 {
        self.num_blocks
    }

    #[inline]
    fn tail(&self) -> u32 {
        self.num_blocks + 1
    }

    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Whether block `index` is linked into the queue. O(1).
    pub(crate) fn contains(&self, index: u32) -> bool {
        self.prev[index as usize] != NOT_LINKED
    }

    /// Removes and returns the least recently freed block, or `None` if the queue is empty.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let first = self.next[self.head() as usize];
        if first == self.tail() {
            return None;
        }
        self.remove(first);
        Some(first)
    }

    /// Appends block `index` at the tail (most recently freed). It must not be linked.
    pub(crate) fn push_back(&mut self, index: u32) {
        assert!(
            index < self.num_blocks,
            "free queue: push_back of out-of-range block {index}"
        );
        assert!(
            !self.contains(index),
            "free queue: block {index} is already in the queue"
        );
        let tail = self.tail();
        let last = self.prev[tail as usize];
        self.next[last as usize] = index;
        self.prev[index as usize] = last;
        self.next[index as usize] = tail;
        self.prev[tail as usize] = index;
        self.len += 1;
    }

    /// Unlinks block `index` from wherever it is in the queue. O(1).
    pub(crate) fn remove(&mut self, index: u32) {
        assert!(
            index < self.num_blocks,
            "free queue: remove of out-of-range block {index}"
        );
        assert!(
            self.contains(index),
            "free queue: block {index} is not in the queue"
        );
        let before = self.prev[index as usize];
        let after = self.next[index as usize];
        self.next[before as usize] = after;
        self.prev[after as usize] = before;
        self.prev[index as usize] = NOT_LINKED;
        self.next[index as usize] = NOT_LINKED;
        self.len -= 1;
    }

    /// Block indices from head (next to allocate) to tail (most recently freed). O(len).
    pub(crate) fn to_vec(&self) -> Vec<u32> {
        let mut order = Vec::with_capacity(self.len as usize);
        let mut cursor = self.next[self.head() as usize];
        while cursor != self.tail() && order.len() <= self.len as usize {
            order.push(cursor);
            cursor = self.next[cursor as usize];
        }
        order
    }

    /// Panics unless the links form one well-formed list from head to tail holding exactly
    /// `len` distinct blocks, and every block outside it has both links unset.
    pub(crate) fn check_invariants(&self) {
        let num_slots = self.num_blocks as usize + 2;
        assert_eq!(
            self.next.len(),
            num_slots,
            "free queue: next has the wrong length"
        );
        assert_eq!(
            self.prev.len(),
            num_slots,
            "free queue: prev has the wrong length"
        );
        assert_eq!(
            self.prev[self.head() as usize],
            NOT_LINKED,
            "free queue: head sentinel has a prev link"
        );
        assert_eq!(
            self.next[self.tail() as usize],
            NOT_LINKED,
            "free queue: tail sentinel has a next link"
        );

        let mut linked = vec![false; self.num_blocks as usize];
        let mut count: u32 = 0;
        let mut before = self.head();
        let mut cursor = self.next[before as usize];
        while cursor != self.tail() {
            assert!(
                cursor < self.num_blocks,
                "free queue: link from {before} points to {cursor}, which is neither a block nor the tail"
            );
            assert!(
                !linked[cursor as usize],
                "free queue: block {cursor} appears twice (cycle)"
            );
            assert_eq!(
                self.prev[cursor as usize], before,
                "free queue: prev of block {cursor} is not the block before it"
            );
            linked[cursor as usize] = true;
            count += 1;
            before = cursor;
            cursor = self.next[cursor as usize];
        }
        assert_eq!(
            self.prev[self.tail() as usize],
            before,
            "free queue: tail's prev is not the last block"
        );
        assert_eq!(
            count, self.len,
            "free queue: walked {count} blocks but len is {}",
            self.len
        );
        for (index, &is_linked) in linked.iter().enumerate() {
            if !is_linked {
                assert!(
                    self.prev[index] == NOT_LINKED && self.next[index] == NOT_LINKED,
                    "free queue: block {index} is not in the list but has links set"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_queue_is_in_id_order() {
        let queue = FreeQueue::new_full(4);
        queue.check_invariants();
        assert_eq!(queue.to_vec(), vec![0, 1, 2, 3]);
        assert_eq!(queue.len(), 4);
    }

    #[test]
    fn pop_front_push_back_and_remove_from_middle() {
        let mut queue = FreeQueue::new_full(5);
        assert_eq!(queue.pop_front(), Some(0));
        assert_eq!(queue.pop_front(), Some(1));
        queue.push_back(0);
        assert_eq!(queue.to_vec(), vec![2, 3, 4, 0]);
        queue.remove(3);
        assert_eq!(queue.to_vec(), vec![2, 4, 0]);
        assert!(!queue.contains(3));
        assert!(queue.contains(4));
        queue.remove(2);
        queue.remove(0);
        assert_eq!(queue.to_vec(), vec![4]);
        queue.check_invariants();
        assert_eq!(queue.pop_front(), Some(4));
        assert_eq!(queue.pop_front(), None);
        assert_eq!(queue.len(), 0);
        queue.check_invariants();
        queue.push_back(1);
        assert_eq!(queue.to_vec(), vec![1]);
        queue.check_invariants();
    }

    #[test]
    fn empty_queue_of_zero_blocks() {
        let mut queue = FreeQueue::new_full(0);
        queue.check_invariants();
        assert_eq!(queue.pop_front(), None);
    }

    #[test]
    #[should_panic(expected = "already in the queue")]
    fn double_push_panics() {
        let mut queue = FreeQueue::new_full(2);
        queue.push_back(1);
    }

    #[test]
    #[should_panic(expected = "not in the queue")]
    fn remove_of_unlinked_block_panics() {
        let mut queue = FreeQueue::new_full(2);
        queue.pop_front();
        queue.remove(0);
    }

    #[test]
    #[should_panic(expected = "appears twice")]
    fn check_invariants_catches_a_cycle() {
        let mut queue = FreeQueue::new_full(3);
        // Corrupt the list on purpose: 2 points back to 1.
        queue.next[2] = 1;
        queue.check_invariants();
    }
}
