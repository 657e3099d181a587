package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"io"
	"math"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// A fingerprint identifies a request, so that a key first used for one
// request is refused for another ([ErrKeyReused]). Those this package makes
// begin with a magic and a version:
//
//	"\xffIDF"  magic, 4 bytes
//	version    1 byte
//
// Version 2 (message bodies of streams, and HTTP and proto requests before
// versions 4 and 3) is flat:
//
//	schema     8 bytes: what the encoding depends on (the kind of request)
//	sum        32 bytes: SHA-256 of the request
//
// Two version 2 fingerprints are compared only when their schema agrees.
//
// Versions 4, 5 and 6 (HTTP requests; 5 compares JSON bodies by value, 6
// reads a Content-Type as RFC 9110 does, and each compares with a row of
// the others as that row's release did): see httpfingerprint.go.
//
// Version 3 (proto requests) has a part per field present, and says once
// per message type which fields its schema knows, so that two releases of
// a request's schema can compare the fields both know:
//
//	method     16 bytes: SHA-256 of the full method, truncated
//	rows       count (uvarint), then count rows: what a message type knows
//	node       the request's message
//	whole      only when the root node is cut: 8 bytes of schema digest,
//	           16 bytes of hash of the whole request
//
//	row        0, then count (uvarint) of runs, each: first number
//	           (uvarint), how many consecutive numbers (uvarint), tag,
//	           flags (1: 16 bytes of the hash of the value an absent scalar
//	           reads as follow, 2: 8 bytes of a closed enum's digest
//	           follow); or, for a type whose runs pass maxRowLen, 1 and 8
//	           bytes of their digest (its fields are known, not listed)
//	node       row (uvarint; 0 only when the walk was cut before the row
//	           fit), count (uvarint) and numbers of the extensions it held
//	           undecoded (its unknown fields in its extension ranges; past
//	           maxUnknown, the number 0 alone: any), the entries of the
//	           fields present, by number, then 0 and flags (1: the walk
//	           was cut in the node, see below; 2: the number (uvarint) of
//	           declared fields present follows, written or not: every node
//	           but an Any's)
//	entry      number (uvarint), tag (1 byte: kind, list, map, in a real
//	           oneof; the key's kind for a map), form (1 byte), by form:
//	  hash       16 bytes: a scalar or a list of scalars
//	  node       a singular message, to maxNodeDepth levels
//	  leaf       8 bytes of schema digest, 16 bytes of hash, then 0 (no
//	             extension can be set below), 1 and 16 bytes of hash of
//	             the extensions set below, or 2 (one below was held
//	             undecoded: not compared): a message below maxNodeDepth, a
//	             closed enum (its digest, then 0)
//	  list       count (uvarint), then each message as form and payload
//	             (node or leaf), or cut (0xff) where the walk stopped
//	  map        count (uvarint), the value's tag (0x80: a closed enum,
//	             8 bytes of its digest follow), then each entry by key:
//	             1, 16 bytes of hash of the key, the value as form and
//	             payload (hash, node or leaf); or cut (0xff)
//	  any        a google.protobuf.Any's value: 16 bytes of hash of its
//	             bytes canonicalised without a schema, then 1 and the
//	             message it packs (node or leaf) when its type is linked
//	             in and the bytes decode, else 0
//
// A field counts as present when it is set and, for a singular scalar
// outside a real oneof, differs from its declared default (what a handler
// reads when it is unset). Two version 3 fingerprints name the same request
// when every field number both nodes list with the same tag holds the same
// value, and a field present on one side only is, on the other, a field its
// row does not know (not comparable: skipped), one that reads as the same
// value there (a scalar equal to the other side's default), an extension
// that side held undecoded (its build did not link it in), or an Any's
// value that unpacks to a message with no field present (what an empty
// value decodes to). Two nodes with the same row are of one schema: a
// field of theirs present on one side only (an extension too, unless held
// undecoded) is another request, whether the row lists it or is a digest.
// A list or map of another length is another request; elements are
// compared one by one; two Anys compare the messages they pack when both
// are unpacked, and their canonical bytes otherwise. So a field added or
// removed by a deploy, a proto2 extension linked in by a rebuild, an Any's
// type linked in, or presence added to a scalar never makes a retry
// KEY_REUSED, while the fields both sides know are still compared
// exactly. One exception, the price of comparing an Any across the
// rebuild that links its type in: an Any unpacked on one side only is
// compared on its canonical bytes, so a packed message re-encoded by the
// client at the same time (an explicit zero, another packing) counts as
// another request; so it does, for the same reason, in a leaf or in
// whole, which never unpack.
//
// A fingerprint is kept under maxFieldsLen: when it would outgrow it (an
// entry or a row that does not fit), the walk stops, and every node then
// open is cut. Fields after the last entry of a cut node are not compared,
// except through the number of declared fields (two nodes of one schema
// holding another number are another request, cut or not: on one build, a
// request cut where another of its schema ended holds more) and through
// whole, when both sides are cut and of one schema. The work is bounded by
// the request's size: only fields present are visited, a row is written
// once per type, and a leaf's extensions are walked only for a type from
// which an extension range can be reached.
//
// Fingerprints of different versions, and tagged against untagged, are not
// comparable: the call counts as the same request, so an upgrade never
// turns a retry into KEY_REUSED. Untagged fingerprints (those of the first
// release, or a caller's own) are compared byte for byte with each other.
const (
	fingerprintMagic   = "\xffIDF"
	fingerprintVersion = 2 // of tagged: the flat format
	fingerprintLen     = len(fingerprintMagic) + 1 + 8 + sha256.Size

	fieldsVersion = 3 // the per-field format of proto requests
	fieldsHeadLen = len(fingerprintMagic) + 1 + hashLen
	hashLen       = 16
	digestLen     = 8
	maxNodeDepth  = 8
	maxFieldsLen  = 16 << 10    // beyond it, the walk stops
	fieldsReserve = 256         // kept free to close a cut walk
	maxRowLen     = 4 << 10     // a longer row is written as its digest
	maxReadDepth  = 64          // of nested nodes when reading
	minMapEntry   = 2 + hashLen // marker, key's hash, value's form
)

// Forms of a version 3 entry, list element or map value.
const (
	formHash byte = iota + 1
	formNode
	formLeaf
	formList
	formMap
	formAny
	formCut = 0xff
)

// What follows a leaf's hash: whether the extensions set below it are
// compared.
const (
	leafNoExtensions byte = iota // none can be set below it
	leafExtensions               // 16 bytes of hash of those set follow
	leafUndecoded                // one below it was not decoded: not compared
)

// Kinds of row.
const (
	rowRuns   byte = iota // the fields, as runs
	rowDigest             // a digest of the runs, for a type too wide
)

// Flags of a node's end.
const (
	closeCut     byte = 1 << iota // the walk stopped in the node
	closeCounted                  // the number of declared fields present follows
)

// maxUnknown is how many extension numbers held undecoded a node lists;
// past it, the list is 0 alone: any of them may be.
const maxUnknown = 16

// Flags of a row's run.
const (
	runDefault byte = 1 << iota // an absent scalar reads as a value
	runEnum                     // a closed enum
)

// Fingerprint identifies a proto request for key-reuse checks: a hash of
// the full method and, for each field present, a hash of its value, with
// what the server's schema knows (see [Call.Fingerprint]). The error is
// always nil; it is kept for callers of the first release.
//
// Values are compared as the server decoded them, never as encoded: fields
// the server does not know (sent by a newer client) are left out, map
// entries count in key order, a singular scalar equal to its declared
// default counts as absent (so adding or removing presence changes
// nothing), -0 is 0 and every NaN is one value, and an Any whose type is
// linked into the server (protoregistry.GlobalTypes) counts as the message
// it packs, by type name whatever the URL's prefix. An Any also counts as
// its bytes with each message level's fields sorted (as far as the bytes
// parse as messages), so its map order does not count either; that form is
// what two Anys are compared on when one of them could not be unpacked (its
// type not linked in, on one side or both, or bytes that do not decode).
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	w := walkers.Get().(*walker)
	defer w.release()
	w.buf = append(w.buf, fullMethod...)
	var method [hashLen]byte
	w.sum(method[:0])
	m := req.ProtoReflect()
	w.node(m, 1)
	out := make([]byte, 0, fieldsHeadLen+binary.MaxVarintLen64+len(w.table)+len(w.out)+digestLen+hashLen)
	out = append(out, fingerprintMagic...)
	out = append(out, fieldsVersion)
	out = append(out, method[:]...)
	out = binary.AppendUvarint(out, w.nrows)
	out = append(out, w.table...)
	out = append(out, w.out...)
	if w.cut {
		// The fields after the cut, compared with another cut request of
		// the same schema only.
		d := planOf(m.Descriptor()).digest
		out = append(out, d[:]...)
		w.message(m)
		out = w.sum(out)
	}
	return out, nil
}

// messageFingerprint identifies a message body of an at-least-once stream.
func messageFingerprint(body []byte) []byte {
	return tagged(kindDigest("message body"), body)
}

// tagged makes a version 2 fingerprint of parts, each length-prefixed so
// that no two lists of parts hash alike.
func tagged(schema [8]byte, parts ...[]byte) []byte {
	h := sha256.New()
	writeParts(h, parts...)
	out := make([]byte, 0, fingerprintLen)
	out = append(out, fingerprintMagic...)
	out = append(out, fingerprintVersion)
	out = append(out, schema[:]...)
	return h.Sum(out)
}

// writeParts writes parts to h, each length-prefixed so that no two lists
// of parts hash alike.
func writeParts(h io.Writer, parts ...[]byte) {
	for _, p := range parts {
		_, _ = h.Write(binary.AppendUvarint(nil, uint64(len(p))))
		_, _ = h.Write(p)
	}
}

// sameRequest reports whether a stored fingerprint and a new one name the
// same request, or cannot be compared (see the format above).
func sameRequest(stored, current []byte) bool {
	if bytes.Equal(stored, current) {
		return true
	}
	if malformedHTTP(stored) || malformedHTTP(current) {
		return false
	}
	if a, ok := readHTTP(stored); ok {
		if b, ok := readHTTP(current); ok {
			return sameHTTP(a, b) // of any version: see sameHTTP
		}
	}
	sv, cv := versionOf(stored), versionOf(current)
	switch {
	case sv != cv:
		return true // another algorithm: not comparable
	case sv == fieldsVersion:
		return sameFields(stored, current)
	case sv == fingerprintVersion:
		head := len(fingerprintMagic) + 1 + 8
		return !bytes.Equal(stored[:head], current[:head]) // another schema: not comparable
	}
	return false // untagged, and not equal
}

// versionOf returns the version of a tagged fingerprint, 0 for an untagged
// one.
func versionOf(fp []byte) byte {
	if len(fp) <= len(fingerprintMagic) || string(fp[:len(fingerprintMagic)]) != fingerprintMagic {
		return 0
	}
	switch v := fp[len(fingerprintMagic)]; {
	case v == fingerprintVersion && len(fp) == fingerprintLen:
		return v
	case v == fieldsVersion && len(fp) > fieldsHeadLen:
		return v
	case v == httpVersion || v == httpVersion5 || v == httpVersion4:
		if _, ok := readHTTP(fp); ok {
			return v
		}
	}
	return 0
}

func kindDigest(kind string) (d [8]byte) {
	sum := sha256.Sum256([]byte("kind " + kind))
	copy(d[:], sum[:])
	return d
}

// sameFields compares two version 3 fingerprints. One that does not parse
// (a caller's own bytes that happen to begin like one) is compared byte
// for byte, and so is different.
func sameFields(stored, current []byte) bool {
	if !bytes.Equal(stored[:fieldsHeadLen], current[:fieldsHeadLen]) {
		return false // another method
	}
	a, ok := readFields(stored[fieldsHeadLen:])
	if !ok {
		return false
	}
	b, ok := readFields(current[fieldsHeadLen:])
	if !ok {
		return false
	}
	if !sameNode(a.root, b.root) {
		return false
	}
	if a.root.cut && b.root.cut && bytes.Equal(a.whole[:digestLen], b.whole[:digestLen]) {
		return bytes.Equal(a.whole, b.whole)
	}
	return true
}

// fpDoc is a parsed version 3 fingerprint, after its method.
type fpDoc struct {
	rows  []*fpRow
	root  *fpNode
	whole []byte // digest and hash, when root is cut
}

// fpRow is what a message type knows: runs of field numbers, by number,
// or, for a type too wide to list, only a digest of them.
type fpRow struct {
	raw    []byte // as written: two rows alike are of one schema
	runs   []fpRun
	digest bool // runs unknown; raw says which schema
}

type fpRun struct {
	first, n  uint64
	tag, flag byte
	def       []byte // runDefault: the hash of the value absent reads as
	enum      []byte // runEnum: the closed enum's digest
}

// find returns the run holding number n, or nil.
func (r *fpRow) find(n uint64) *fpRun {
	i, _ := slices.BinarySearchFunc(r.runs, n, func(run fpRun, n uint64) int {
		switch {
		case run.first+run.n <= n:
			return -1
		case run.first > n:
			return 1
		}
		return 0
	})
	if i < len(r.runs) && r.runs[i].first <= n && n < r.runs[i].first+r.runs[i].n {
		return &r.runs[i]
	}
	return nil
}

// fpNode is a parsed node: its row (unknown when the walk was cut before
// it), the extension numbers it holds undecoded, its entries, and when cut
// how many declared fields it holds.
type fpNode struct {
	row      *fpRow
	unknown  []uint64
	entries  []fpEntry
	cut      bool
	counted  bool   // declared was written (every node but an Any's)
	declared uint64 // declared fields present, written or not
}

type fpEntry struct {
	num uint64
	tag byte
	fpValue
}

// fpValue is an entry's, a list element's or a map value's payload.
type fpValue struct {
	form    byte
	digest  []byte // leaf; map: the value's tag and closed enum digest
	hash    []byte // hash, leaf, any (the canonical bytes)
	ext     byte   // leaf: what follows its hash
	extHash []byte // leaf: the hash of the extensions set below it
	node    *fpNode
	packed  *fpValue // any, when unpacked
	count   uint64   // list, map
	items   []fpItem // list, map: those written before a cut
}

type fpItem struct {
	key []byte // map
	fpValue
}

// fpReader parses a version 3 fingerprint; ok turns false for good at
// the first malformed byte.
type fpReader struct {
	b    []byte
	ok   bool
	rows []*fpRow
}

func (r *fpReader) byte() byte {
	if len(r.b) < 1 {
		r.ok = false
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *fpReader) uvarint() uint64 {
	v, k := binary.Uvarint(r.b)
	if k <= 0 {
		r.ok = false
		return 0
	}
	r.b = r.b[k:]
	return v
}

func (r *fpReader) bytes(n int) []byte {
	if len(r.b) < n {
		r.ok = false
		return nil
	}
	b := r.b[:n]
	r.b = r.b[n:]
	return b
}

func readFields(b []byte) (fpDoc, bool) {
	r := &fpReader{b: b, ok: true}
	n := r.uvarint()
	if n > uint64(len(r.b)) {
		return fpDoc{}, false
	}
	for range n {
		if r.rows = append(r.rows, r.row()); !r.ok {
			return fpDoc{}, false
		}
	}
	doc := fpDoc{rows: r.rows, root: r.node(0)}
	if r.ok && doc.root.cut {
		doc.whole = r.bytes(digestLen + hashLen)
	}
	return doc, r.ok && len(r.b) == 0
}

func (r *fpReader) row() *fpRow {
	start := r.b
	row := &fpRow{}
	switch r.byte() {
	case rowRuns:
	case rowDigest:
		r.bytes(digestLen)
		row.raw, row.digest = start[:len(start)-len(r.b)], true
		return row
	default:
		r.ok = false
		return nil
	}
	n := r.uvarint()
	if n > uint64(len(r.b)) {
		r.ok = false
		return nil
	}
	row.runs = make([]fpRun, 0, n)
	for range n {
		run := fpRun{first: r.uvarint(), n: r.uvarint(), tag: r.byte(), flag: r.byte()}
		if run.flag&runDefault != 0 {
			run.def = r.bytes(hashLen)
		}
		if run.flag&runEnum != 0 {
			run.enum = r.bytes(digestLen)
		}
		if !r.ok || run.n == 0 || len(row.runs) > 0 && row.runs[len(row.runs)-1].first+row.runs[len(row.runs)-1].n > run.first {
			r.ok = false
			return nil
		}
		row.runs = append(row.runs, run)
	}
	row.raw = start[:len(start)-len(r.b)]
	return row
}

func (r *fpReader) node(depth int) *fpNode {
	nd := &fpNode{}
	if depth > maxReadDepth {
		r.ok = false
		return nd
	}
	if i := r.uvarint(); i > uint64(len(r.rows)) {
		r.ok = false
	} else if i > 0 {
		nd.row = r.rows[i-1]
	}
	if n := r.uvarint(); n > uint64(len(r.b)) {
		r.ok = false
	} else {
		for range n {
			nd.unknown = append(nd.unknown, r.uvarint())
		}
	}
	for r.ok {
		e := fpEntry{num: r.uvarint()}
		if e.num == 0 {
			flags := r.byte()
			nd.cut, nd.counted = flags&closeCut != 0, flags&closeCounted != 0
			if nd.counted {
				nd.declared = r.uvarint()
			}
			if flags&^(closeCut|closeCounted) != 0 || nd.row == nil && !nd.cut {
				r.ok = false // only a cut leaves a row out
			}
			return nd
		}
		if len(nd.entries) > 0 && nd.entries[len(nd.entries)-1].num >= e.num {
			r.ok = false
		}
		e.tag = r.byte()
		e.fpValue = r.value(r.byte(), depth)
		nd.entries = append(nd.entries, e)
	}
	return nd
}

func (r *fpReader) value(form byte, depth int) fpValue {
	v := fpValue{form: form}
	switch form {
	case formHash:
		v.hash = r.bytes(hashLen)
	case formLeaf:
		v.digest, v.hash = r.bytes(digestLen), r.bytes(hashLen)
		switch v.ext = r.byte(); v.ext {
		case leafNoExtensions, leafUndecoded:
		case leafExtensions:
			v.extHash = r.bytes(hashLen)
		default:
			r.ok = false
		}
	case formNode:
		v.node = r.node(depth + 1)
	case formAny:
		v.hash = r.bytes(hashLen)
		switch r.byte() {
		case 0:
		case 1:
			packed := r.value(r.byte(), depth)
			v.packed = &packed
		default:
			r.ok = false
		}
	case formList, formMap:
		v.count = r.uvarint()
		if form == formMap {
			start := r.b
			if r.byte()&0x80 != 0 {
				r.bytes(digestLen)
			}
			v.digest = start[:len(start)-len(r.b)]
		}
		for i := uint64(0); i < v.count && r.ok; i++ {
			c := r.byte()
			if c == formCut {
				break
			}
			var it fpItem
			if form == formMap {
				if c != 1 {
					r.ok = false
				}
				it.key, c = r.bytes(hashLen), r.byte()
			}
			if it.fpValue = r.value(c, depth); it.form == formList || it.form == formMap || it.form == formAny {
				r.ok = false
			}
			v.items = append(v.items, it)
		}
	default:
		r.ok = false
	}
	return v
}

// sameNode reports whether two nodes hold the same values in every field
// both can compare.
func sameNode(a, b *fpNode) bool {
	if (a.cut || b.cut) && a.counted && b.counted && a.declared != b.declared && sameRow(a, b) {
		// Of one schema, with another number of fields: what the cut left
		// out differs.
		return false
	}
	i, j := 0, 0
	for i < len(a.entries) || j < len(b.entries) {
		switch {
		case j == len(b.entries) || i < len(a.entries) && a.entries[i].num < b.entries[j].num:
			if !absentAlike(a.entries[i], a, b) {
				return false
			}
			i++
		case i == len(a.entries) || b.entries[j].num < a.entries[i].num:
			if !absentAlike(b.entries[j], b, a) {
				return false
			}
			j++
		default:
			x, y := a.entries[i], b.entries[j]
			i, j = i+1, j+1
			if x.tag == y.tag && !sameValue(&x.fpValue, &y.fpValue) {
				return false
			}
		}
	}
	return true
}

// sameRow reports whether two nodes are of one schema.
func sameRow(a, b *fpNode) bool {
	return a.row != nil && b.row != nil && bytes.Equal(a.row.raw, b.row.raw)
}

// absentAlike reports whether node other, which lacks field x of node
// self, may hold the same request: true when other does not know x's field
// (another schema, an extension it held undecoded, or past the cut) or
// reads it as x's value.
func absentAlike(x fpEntry, self, other *fpNode) bool {
	if other.cut && (len(other.entries) == 0 || x.num > other.entries[len(other.entries)-1].num) {
		return true // past the cut: not compared
	}
	if x.form == formAny && x.packed != nil && emptyPacked(x.packed) {
		return true // an Any's value of defaults only: as an empty one
	}
	if other.row == nil {
		return true
	}
	var run *fpRun
	if !other.row.digest {
		run = other.row.find(x.num)
	}
	if run == nil {
		if !sameRow(self, other) {
			return true // a field other's schema does not know
		}
		// One schema: a declared field of a wide type, or an extension,
		// which other either held undecoded (not linked into its build:
		// not comparable) or was not sent.
		return slices.Contains(other.unknown, x.num) || slices.Contains(other.unknown, 0)
	}
	if run.tag != x.tag {
		return true // a field other's schema does not know
	}
	if protoreflect.Kind(x.tag&0x1f) == protoreflect.EnumKind && x.tag&0x40 == 0 &&
		(x.form == formLeaf || run.flag&runEnum != 0) && !bytes.Equal(x.digest, run.enum) {
		// A closed enum: a value the other schema does not know is
		// absent there, so only the same set of values compares.
		return true
	}
	if run.flag&runDefault != 0 && (x.form == formHash || x.form == formLeaf) {
		return bytes.Equal(x.hash, run.def)
	}
	return false // present on one side only
}

// emptyLeaf is the hash of a leaf with no field present.
var emptyLeaf = func() []byte { s := sha256.Sum256([]byte{0}); return s[:hashLen] }()

// emptyPacked reports whether an Any's unpacked message holds no field: the
// message an empty value decodes to.
func emptyPacked(v *fpValue) bool {
	switch v.form {
	case formNode:
		return len(v.node.entries) == 0 && !v.node.cut
	case formLeaf:
		return bytes.Equal(v.hash, emptyLeaf) && v.ext != leafExtensions
	}
	return false
}

// sameValue compares two values of one field with the same number and
// tag; true when they are the same or not comparable.
func sameValue(x, y *fpValue) bool {
	switch {
	case x.form != y.form:
		return true // encoded another way since: not comparable
	case x.form == formLeaf && !bytes.Equal(x.digest, y.digest):
		return true // the schema below changed: not comparable
	case x.form == formLeaf && x.ext != leafUndecoded && y.ext != leafUndecoded &&
		(x.ext != y.ext || !bytes.Equal(x.extHash, y.extHash)):
		return false // extensions, decoded on both sides, differ
	case x.form == formHash || x.form == formLeaf:
		return bytes.Equal(x.hash, y.hash)
	case x.form == formNode:
		return sameNode(x.node, y.node)
	case x.form == formAny:
		if x.packed != nil && y.packed != nil {
			return sameValue(x.packed, y.packed)
		}
		return bytes.Equal(x.hash, y.hash)
	case x.form == formMap && !bytes.Equal(x.digest, y.digest):
		return true // another kind of value: not comparable
	}
	// A list or a map.
	if x.count != y.count {
		return false
	}
	for i := range min(len(x.items), len(y.items)) {
		if !bytes.Equal(x.items[i].key, y.items[i].key) || !sameValue(&x.items[i].fpValue, &y.items[i].fpValue) {
			return false
		}
	}
	return true
}

// walker computes one fingerprint. Values are appended to buf, which is
// hashed by h when it grows or a hash is taken; entries are appended to
// out, and the rows of the types met to table.
type walker struct {
	h       hash.Hash
	buf     []byte // starts as small
	small   [512]byte
	scratch [sha256.Size]byte

	out   []byte
	table []byte
	rows  []rowRef // by type, the rows met
	nrows uint64   // rows in table
	cut   bool     // the walk stopped at maxFieldsLen

	canon   canonical
	nums    []uint64              // scratch of unknownExtensions
	keys    []protoreflect.MapKey // scratch of sortedKeys, a segment per map
	fields  []presentField        // of the messages being walked, a segment each
	plan    *msgPlan              // of the message collect is ranging over
	collect func(protoreflect.FieldDescriptor, protoreflect.Value) bool
}

// rowRef is the index of a type's row.
type rowRef struct {
	p *msgPlan
	i uint64
}

// presentField is a field that counts as present, and its value.
type presentField struct {
	f *fieldPlan
	v protoreflect.Value
}

func newWalker() *walker {
	w := &walker{h: sha256.New()}
	w.buf = w.small[:0]
	w.collect = w.collectField
	return w
}

// walkers keeps walkers and their buffers between fingerprints.
var walkers = sync.Pool{New: func() any { return newWalker() }}

// release returns w to walkers, unless a large request grew its buffers.
func (w *walker) release() {
	if cap(w.out) > 2*maxFieldsLen || cap(w.fields) > 1<<10 || cap(w.rows) > 1<<10 || cap(w.keys) > 1<<10 ||
		cap(w.canon.arena) > 64<<10 || cap(w.canon.spans) > 4<<10 || cap(w.canon.fields) > 4<<10 {
		return
	}
	clear(w.fields[:cap(w.fields)])
	clear(w.rows[:cap(w.rows)])
	clear(w.keys[:cap(w.keys)])
	w.h.Reset()
	w.buf, w.out, w.table, w.rows, w.fields, w.keys = w.small[:0], w.out[:0], w.table[:0], w.rows[:0], w.fields[:0], w.keys[:0]
	w.nrows, w.cut, w.plan = 0, false, nil
	walkers.Put(w)
}

// sum appends the hash of what was written since the last sum to out.
func (w *walker) sum(out []byte) []byte {
	w.flush()
	s := w.h.Sum(w.scratch[:0])
	w.h.Reset()
	return append(out, s[:hashLen]...)
}

func (w *walker) flush() {
	w.h.Write(w.buf)
	w.buf = w.buf[:0]
}

// room reports whether the walk may write one more entry; once it may not,
// the walk is cut for good.
func (w *walker) room() bool {
	if !w.cut && len(w.out)+len(w.table) > maxFieldsLen-fieldsReserve {
		w.cut = true
	}
	return !w.cut
}

// row returns the index of p's row in the table, adding it the first
// time; when it does not fit, the walk is cut there and row returns 0.
func (w *walker) row(p *msgPlan) uint64 {
	for _, r := range w.rows {
		if r.p == p {
			return r.i
		}
	}
	if w.cut || len(w.out)+len(w.table)+len(p.row) > maxFieldsLen-fieldsReserve {
		w.cut = true
		return 0
	}
	w.table = append(w.table, p.row...)
	w.nrows++
	w.rows = append(w.rows, rowRef{p, w.nrows})
	return w.nrows
}

// unknownExtensions appends the list of the numbers of m's extensions
// held undecoded.
func (w *walker) unknownExtensions(m protoreflect.Message, p *msgPlan) {
	if !p.extensible {
		w.out = append(w.out, 0)
		return
	}
	nums := w.undecoded(m)
	if len(nums) > maxUnknown {
		nums = append(nums[:0], 0)
	}
	w.out = binary.AppendUvarint(w.out, uint64(len(nums)))
	for _, n := range nums {
		w.out = binary.AppendUvarint(w.out, n)
	}
}

// undecoded returns, sorted, the numbers of m's unknown fields that lie
// in its extension ranges: extensions its build did not link in. The
// slice is w's scratch, valid until the next call.
func (w *walker) undecoded(m protoreflect.Message) []uint64 {
	nums := w.nums[:0]
	ranges := m.Descriptor().ExtensionRanges()
	for u := m.GetUnknown(); len(u) > 0; {
		num, typ, n := protowire.ConsumeTag(u)
		if n < 0 {
			break
		}
		k := protowire.ConsumeFieldValue(num, typ, u[n:])
		if k < 0 {
			break
		}
		u = u[n+k:]
		if ranges.Has(num) {
			nums = append(nums, uint64(num))
		}
	}
	slices.Sort(nums)
	w.nums = slices.Compact(nums)
	return w.nums
}

// present collects the fields of m that count as present, by number, onto
// w.fields, and returns where they start; the caller truncates w.fields
// back to it when done.
func (w *walker) present(m protoreflect.Message, p *msgPlan) int {
	start := len(w.fields)
	w.plan = p
	m.Range(w.collect)
	slices.SortFunc(w.fields[start:], func(a, b presentField) int { return cmp.Compare(a.f.number, b.f.number) })
	return start
}

func (w *walker) collectField(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
	var f *fieldPlan
	if fd.IsExtension() {
		f = extensionPlan(fd)
	} else {
		f = &w.plan.fields[fd.Index()]
	}
	if !f.zeroAbsent || !isDefault(fd, v) {
		w.fields = append(w.fields, presentField{f, v})
	}
	return true
}

// node appends m's node to out.
func (w *walker) node(m protoreflect.Message, depth int) {
	p := planOf(m.Descriptor())
	w.out = binary.AppendUvarint(w.out, w.row(p))
	w.unknownExtensions(m, p)
	if p.isAny {
		w.anyEntries(m, p, depth)
		w.out = append(w.out, 0, byte(b2i(w.cut))*closeCut)
		return
	}
	start := w.present(m, p)
	var declared uint64
	for _, pf := range w.fields[start:] {
		declared += uint64(b2i(!pf.f.fd.IsExtension()))
	}
	for i := start; i < len(w.fields) && w.room(); i++ {
		pf := w.fields[i]
		w.entry(pf.f, pf.v, depth)
	}
	w.fields = w.fields[:start]
	w.out = append(w.out, 0, byte(b2i(w.cut))*closeCut|closeCounted)
	w.out = binary.AppendUvarint(w.out, declared)
}

// entry appends the entry of field f, of value v.
func (w *walker) entry(f *fieldPlan, v protoreflect.Value, depth int) {
	w.out = binary.AppendUvarint(w.out, uint64(f.number))
	w.out = append(w.out, f.tag)
	fd := f.fd
	switch {
	case fd.IsMap():
		w.mapEntry(fd, v.Map(), depth)
	case f.isMsg && fd.IsList():
		l := v.List()
		w.out = append(w.out, formList)
		w.out = binary.AppendUvarint(w.out, uint64(l.Len()))
		for i := range l.Len() {
			if !w.room() {
				w.out = append(w.out, formCut)
				return
			}
			w.messageValue(l.Get(i).Message(), depth)
		}
	case f.isMsg:
		w.messageValue(v.Message(), depth)
	case f.closed:
		w.out = append(w.out, formLeaf)
		w.out = append(w.out, f.enum[:]...)
		w.value(fd, v)
		w.out = append(w.sum(w.out), leafNoExtensions)
	default:
		w.out = append(w.out, formHash)
		w.value(fd, v)
		w.out = w.sum(w.out)
	}
}

// messageValue appends the form and payload of a message value: a node,
// or below maxNodeDepth a leaf.
func (w *walker) messageValue(m protoreflect.Message, depth int) {
	if depth < maxNodeDepth {
		w.out = append(w.out, formNode)
		w.node(m, depth+1)
		return
	}
	p := planOf(m.Descriptor())
	w.out = append(w.out, formLeaf)
	w.out = append(w.out, p.digest[:]...)
	w.message(m)
	w.out = w.sum(w.out)
	switch {
	case !p.mayExtend:
		w.out = append(w.out, leafNoExtensions)
	case w.extensions(m):
		w.out = w.sum(append(w.out, leafExtensions))
	default:
		w.flush()
		w.h.Reset()
		w.out = append(w.out, leafUndecoded)
	}
}

// extensions writes the extensions set in m and in the messages below it,
// each under the path of fields that leads to it; false, at once, when one
// of those messages holds an extension undecoded (not linked into this
// build).
func (w *walker) extensions(m protoreflect.Message) bool {
	p := planOf(m.Descriptor())
	if !p.mayExtend {
		return true
	}
	if p.extensible && len(w.undecoded(m)) > 0 {
		return false
	}
	start := w.present(m, p)
	defer func() { w.fields = w.fields[:start] }()
	for i := start; i < len(w.fields); i++ {
		pf := w.fields[i]
		fd := pf.f.fd
		switch {
		case fd.IsExtension():
			w.buf = binary.AppendUvarint(w.buf, uint64(pf.f.number))
			w.buf = append(w.buf, pf.f.tag)
			w.value(fd, pf.v)
		case !pf.f.isMsg:
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				continue
			}
			mp := pf.v.Map()
			keys, kstart := w.sortedKeys(fd, mp)
			for _, k := range keys {
				w.buf = binary.AppendUvarint(w.buf, uint64(pf.f.number))
				w.single(fd.MapKey(), k.Value())
				if !w.extensions(mp.Get(k).Message()) {
					w.keys = w.keys[:kstart]
					return false
				}
			}
			w.keys = w.keys[:kstart]
		case fd.IsList():
			l := pf.v.List()
			for j := range l.Len() {
				w.buf = binary.AppendUvarint(binary.AppendUvarint(w.buf, uint64(pf.f.number)), uint64(j))
				if !w.extensions(l.Get(j).Message()) {
					return false
				}
			}
		default:
			w.buf = binary.AppendUvarint(w.buf, uint64(pf.f.number))
			if !w.extensions(pf.v.Message()) {
				return false
			}
		}
	}
	w.buf = append(w.buf, 0)
	w.spill()
	return true
}

// mapEntry appends a map's payload, its entries in key order.
func (w *walker) mapEntry(fd protoreflect.FieldDescriptor, mp protoreflect.Map, depth int) {
	w.out = append(w.out, formMap)
	w.out = binary.AppendUvarint(w.out, uint64(mp.Len()))
	vfd := fd.MapValue()
	vtag := byte(vfd.Kind()) & 0x1f
	if ed := vfd.Enum(); ed != nil && ed.IsClosed() {
		d := enumDigest(ed)
		w.out = append(append(w.out, vtag|0x80), d[:]...)
	} else {
		w.out = append(w.out, vtag)
	}
	// An entry takes at least minMapEntry bytes: of a large map, only the
	// first keys can fit before the cut, and only those are sorted.
	fit := (maxFieldsLen-fieldsReserve-len(w.out)-len(w.table))/minMapEntry + 1
	keys, start := w.firstKeys(fd, mp, max(fit, 1))
	defer func() { w.keys = w.keys[:start] }()
	for _, k := range keys {
		if !w.room() {
			w.out = append(w.out, formCut)
			return
		}
		w.out = append(w.out, 1)
		w.single(fd.MapKey(), k.Value())
		w.out = w.sum(w.out)
		if v := mp.Get(k); vfd.Message() != nil {
			w.messageValue(v.Message(), depth)
		} else {
			w.out = append(w.out, formHash)
			w.single(vfd, v)
			w.out = w.sum(w.out)
		}
	}
	if len(keys) < mp.Len() {
		// The keys left out would not have fit.
		w.cut = true
		w.out = append(w.out, formCut)
	}
}

// anyEntries appends the entries of an Any: its type name (field 1), and
// its value (field 2) both canonicalised without a schema and, when the
// type is linked in and the bytes decode, as the message it packs.
func (w *walker) anyEntries(m protoreflect.Message, p *msgPlan, depth int) {
	name, value := anyParts(m, p)
	if name != "" && w.room() {
		f := &p.fields[p.anyURL]
		w.out = binary.AppendUvarint(w.out, uint64(f.number))
		w.out = append(w.out, f.tag, formHash)
		w.buf = binary.AppendUvarint(w.buf, uint64(len(name)))
		w.buf = append(w.buf, name...)
		w.out = w.sum(w.out)
	}
	if len(value) == 0 || !w.room() {
		return
	}
	f := &p.fields[p.anyValue]
	w.out = binary.AppendUvarint(w.out, uint64(f.number))
	w.out = append(w.out, f.tag, formAny)
	w.wire(value)
	w.out = w.sum(w.out)
	if packed := unpack(name, value); packed != nil {
		w.out = append(w.out, 1)
		w.messageValue(packed, depth)
		return
	}
	w.out = append(w.out, 0)
}

// anyParts returns the type name of an Any's URL (what follows its last
// slash: the prefix names no part of the type) and its value.
func anyParts(m protoreflect.Message, p *msgPlan) (string, []byte) {
	url := m.Get(p.fields[p.anyURL].fd).String()
	return url[strings.LastIndexByte(url, '/')+1:], m.Get(p.fields[p.anyValue].fd).Bytes()
}

// unpack returns the message an Any packs, when its type is linked in and
// its bytes decode; nil otherwise.
func unpack(name string, value []byte) protoreflect.Message {
	if name == "" {
		return nil
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(name))
	if err != nil {
		return nil
	}
	m := mt.New()
	if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(value, m.Interface()); err != nil {
		return nil
	}
	return m
}

// value writes the value of field fd.
func (w *walker) value(fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	switch {
	case fd.IsMap():
		mp := v.Map()
		w.buf = binary.AppendUvarint(w.buf, uint64(mp.Len()))
		keys, start := w.sortedKeys(fd, mp)
		for _, k := range keys {
			w.single(fd.MapKey(), k.Value())
			w.single(fd.MapValue(), mp.Get(k))
			w.spill()
		}
		w.keys = w.keys[:start]
	case fd.IsList():
		l := v.List()
		w.buf = binary.AppendUvarint(w.buf, uint64(l.Len()))
		for i := range l.Len() {
			w.single(fd, l.Get(i))
			w.spill()
		}
	default:
		w.single(fd, v)
	}
}

// sortedKeys returns a map's keys in order, appended to w.keys from start;
// the caller truncates w.keys back to start when done.
func (w *walker) sortedKeys(fd protoreflect.FieldDescriptor, mp protoreflect.Map) (keys []protoreflect.MapKey, start int) {
	return w.firstKeys(fd, mp, mp.Len())
}

// firstKeys is sortedKeys for the n first keys only: of a map much larger
// than n, it keeps the n first in a heap rather than sorting them all.
func (w *walker) firstKeys(fd protoreflect.FieldDescriptor, mp protoreflect.Map, n int) (keys []protoreflect.MapKey, start int) {
	order := keyOrder(fd)
	start = len(w.keys)
	if mp.Len() <= 2*n {
		w.keys = slices.Grow(w.keys, mp.Len())
		mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
			w.keys = append(w.keys, k)
			return true
		})
		keys = w.keys[start:]
		slices.SortFunc(keys, order)
		return keys, start
	}
	// A max-heap of the n first keys met.
	w.keys = slices.Grow(w.keys, n)
	mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
		h := w.keys[start:]
		if len(h) < n {
			w.keys = append(w.keys, k)
			h = w.keys[start:]
			for i := len(h) - 1; i > 0 && order(h[(i-1)/2], h[i]) < 0; i = (i - 1) / 2 {
				h[i], h[(i-1)/2] = h[(i-1)/2], h[i]
			}
			return true
		}
		if order(k, h[0]) >= 0 {
			return true
		}
		h[0] = k
		for i := 0; ; {
			c := 2*i + 1
			if c >= len(h) {
				break
			}
			if c+1 < len(h) && order(h[c], h[c+1]) < 0 {
				c++
			}
			if order(h[i], h[c]) >= 0 {
				break
			}
			h[i], h[c] = h[c], h[i]
			i = c
		}
		return true
	})
	keys = w.keys[start:]
	slices.SortFunc(keys, order)
	return keys, start
}

// keyOrder returns the order of a map's keys.
func keyOrder(fd protoreflect.FieldDescriptor) func(a, b protoreflect.MapKey) int {
	switch fd.MapKey().Kind() {
	case protoreflect.StringKind:
		return func(a, b protoreflect.MapKey) int { return strings.Compare(a.String(), b.String()) }
	case protoreflect.BoolKind:
		return func(a, b protoreflect.MapKey) int { return cmp.Compare(b2i(a.Bool()), b2i(b.Bool())) }
	case protoreflect.Uint32Kind, protoreflect.Uint64Kind, protoreflect.Fixed32Kind, protoreflect.Fixed64Kind:
		return func(a, b protoreflect.MapKey) int { return cmp.Compare(a.Uint(), b.Uint()) }
	}
	return func(a, b protoreflect.MapKey) int { return cmp.Compare(a.Int(), b.Int()) }
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// single writes one scalar or message value of fd's kind.
func (w *walker) single(fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		w.buf = append(w.buf, byte(b2i(v.Bool())))
	case protoreflect.EnumKind:
		w.buf = binary.AppendVarint(w.buf, int64(v.Enum()))
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		w.buf = binary.AppendVarint(w.buf, v.Int())
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		w.buf = binary.AppendUvarint(w.buf, v.Uint())
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		w.buf = binary.LittleEndian.AppendUint64(w.buf, floatBits(v.Float()))
	case protoreflect.StringKind:
		w.str(v.String())
	case protoreflect.BytesKind:
		w.bytes(v.Bytes())
	case protoreflect.MessageKind, protoreflect.GroupKind:
		w.message(v.Message())
	}
}

// bytes writes b, length-prefixed.
func (w *walker) bytes(b []byte) {
	w.buf = binary.AppendUvarint(w.buf, uint64(len(b)))
	if len(b) > len(w.small) {
		w.flush()
		w.h.Write(b)
		return
	}
	w.buf = append(w.buf, b...)
	w.spill()
}

// str writes s, length-prefixed; a long one through small, in chunks, to
// spare a copy of it.
func (w *walker) str(s string) {
	w.buf = binary.AppendUvarint(w.buf, uint64(len(s)))
	if len(s) <= len(w.small) {
		w.buf = append(w.buf, s...)
		w.spill()
		return
	}
	w.flush()
	for len(s) > 0 {
		n := copy(w.small[:], s)
		w.h.Write(w.small[:n])
		s = s[n:]
	}
}

// spill hashes buf once it outgrows its first array.
func (w *walker) spill() {
	if len(w.buf) > len(w.small) {
		w.flush()
	}
}

// floatBits is f's bits with -0 as 0 and every NaN as one.
func floatBits(f float64) uint64 {
	switch {
	case f != f:
		return 0x7ff8000000000001
	case f == 0:
		return 0
	}
	return math.Float64bits(f)
}

// message writes m whole, for a leaf: its fields present in number order,
// each as number, tag and value, then a 0 (no field's number). So that
// the hash depends on the schema alone (its digest), extensions are left
// out (a leaf hashes them apart: see extensions) and an Any counts as its
// type name and canonical bytes, never as the message it packs.
func (w *walker) message(m protoreflect.Message) {
	p := planOf(m.Descriptor())
	if p.isAny {
		name, value := anyParts(m, p)
		w.str(name)
		w.wire(value)
		return
	}
	start := w.present(m, p)
	for i := start; i < len(w.fields); i++ {
		pf := w.fields[i]
		if pf.f.fd.IsExtension() {
			continue
		}
		w.buf = binary.AppendUvarint(w.buf, uint64(pf.f.number))
		w.buf = append(w.buf, pf.f.tag)
		w.value(pf.f.fd, pf.v)
	}
	w.fields = w.fields[:start]
	w.buf = append(w.buf, 0)
	w.spill()
}

// wire writes the bytes of a message whose schema is unknown, with each
// level's fields sorted (see canonical.sum); bytes that do not parse as a
// message are written as they are.
func (w *walker) wire(b []byte) {
	if w.canon.h == nil {
		w.canon.h = sha256.New()
	}
	if c, ok := w.canon.sum(b, 0); ok {
		w.buf = append(w.buf, 'c')
		w.buf = append(w.buf, c[:]...)
		w.spill()
		return
	}
	w.buf = append(w.buf, 'r')
	w.bytes(b)
}

// canonical is the scratch space of canonical.sum, shared by its levels:
// each appends after its parent's and truncates back when done.
type canonical struct {
	h       hash.Hash
	scratch [sha256.Size]byte
	arena   []byte      // the summaries of length-delimited fields
	spans   []wireField // the fields of the levels being read
	fields  [][]byte    // of the level being hashed
}

// wireField is one field of a level: bytes of the input, or of arena.
type wireField struct {
	inArena  bool
	from, to int
}

// sum hashes the bytes of a message whose schema is unknown so that the
// order of its fields, at every level whose bytes parse as a message, does
// not count: each field counts as its tag and value, a length-delimited
// one as its tag and, when its content parses as a message, the canonical
// sum of it, else the hash of its content; the fields are sorted and
// hashed. Two encodings of one message that differ in field or map order
// give the same sum; so may two that differ in the order of a repeated
// field, or in a string that happens to parse as a message (a missed
// reuse, never a false one). Each byte is hashed once per level it is
// nested in.
func (c *canonical) sum(b []byte, depth int) ([sha256.Size]byte, bool) {
	arenaStart, start := len(c.arena), len(c.spans)
	sum, ok := c.level(b, depth)
	c.arena, c.spans = c.arena[:arenaStart], c.spans[:start]
	return sum, ok
}

// level is sum without the truncation of the scratch space.
func (c *canonical) level(b []byte, depth int) (sum [sha256.Size]byte, ok bool) {
	if depth > 32 {
		return sum, false
	}
	start := len(c.spans)
	for rest := b; len(rest) > 0; {
		num, typ, n := protowire.ConsumeTag(rest)
		if n < 0 {
			return sum, false
		}
		if typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(rest[n:])
			if m < 0 {
				return sum, false
			}
			inner, ok := c.sum(v, depth+1)
			from := len(c.arena)
			c.arena = protowire.AppendTag(c.arena, num, typ)
			if ok && len(v) > 0 {
				c.arena = append(append(c.arena, 'c'), inner[:]...)
			} else {
				inner = sha256.Sum256(v)
				c.arena = append(append(c.arena, 'r'), inner[:]...)
			}
			c.spans = append(c.spans, wireField{true, from, len(c.arena)})
			n += m
		} else {
			m := protowire.ConsumeFieldValue(num, typ, rest[n:])
			if m < 0 {
				return sum, false
			}
			n += m
			from := len(b) - len(rest)
			c.spans = append(c.spans, wireField{false, from, from + n})
		}
		rest = rest[n:]
	}
	fields := c.fields[:0]
	for _, s := range c.spans[start:] {
		if s.inArena {
			fields = append(fields, c.arena[s.from:s.to])
		} else {
			fields = append(fields, b[s.from:s.to])
		}
	}
	slices.SortFunc(fields, bytes.Compare)
	c.h.Reset()
	for _, f := range fields {
		c.h.Write(f)
	}
	copy(sum[:], c.h.Sum(c.scratch[:0]))
	clear(fields)
	c.fields = fields[:0]
	return sum, true
}

// msgPlan is what a fingerprint needs of a message's schema, made once per
// descriptor.
type msgPlan struct {
	fields           []fieldPlan // by declaration index (fd.Index())
	isAny            bool
	extensible       bool    // it has extension ranges
	mayExtend        bool    // it or a message below it has some
	anyURL, anyValue int     // an Any's fields, by index
	digest           [8]byte // of the message as a leaf (schemaDigest)
	row              []byte  // the fields it knows (see the format)
}

// fieldPlan is what a fingerprint needs of one field.
type fieldPlan struct {
	fd         protoreflect.FieldDescriptor
	number     protoreflect.FieldNumber
	tag        byte
	isMsg      bool
	zeroAbsent bool    // a singular scalar outside a real oneof: its default counts as absent
	closed     bool    // a closed enum: compared only with the same set of values
	enum       [8]byte // closed: enumDigest
	def        []byte  // zeroAbsent: the hash of its default
}

func makeFieldPlan(fd protoreflect.FieldDescriptor) fieldPlan {
	f := fieldPlan{fd: fd, number: fd.Number(), tag: byte(fd.Kind()) & 0x1f, isMsg: fd.Message() != nil}
	if fd.IsList() {
		f.tag |= 0x20
	}
	if fd.IsMap() {
		// The key's kind: the order of the entries depends on it.
		f.tag = byte(fd.MapKey().Kind())&0x1f | 0x40
	}
	if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() {
		f.tag |= 0x80
	}
	if ed := fd.Enum(); ed != nil && ed.IsClosed() && !fd.IsMap() {
		// A value the schema does not know is dropped: only the same set
		// of values compares.
		f.closed, f.enum = true, enumDigest(ed)
	}
	f.zeroAbsent = !fd.IsList() && !fd.IsMap() && !f.isMsg && f.tag&0x80 == 0
	if f.zeroAbsent {
		w := newWalker()
		w.single(fd, fd.Default())
		f.def = w.sum(nil)
	}
	return f
}

// isDefault reports whether v is fd's declared default, what a handler
// reads when the field is unset.
func isDefault(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
	d := fd.Default()
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return v.Bool() == d.Bool()
	case protoreflect.EnumKind:
		return v.Enum() == d.Enum()
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return v.Int() == d.Int()
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return v.Uint() == d.Uint()
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return floatBits(v.Float()) == floatBits(d.Float())
	case protoreflect.StringKind:
		return v.String() == d.String()
	case protoreflect.BytesKind:
		return bytes.Equal(v.Bytes(), d.Bytes())
	}
	return false
}

// plans caches planOf by descriptor, and extensionPlan by extension.
var plans sync.Map // protoreflect.Descriptor -> *msgPlan or *fieldPlan

func planOf(md protoreflect.MessageDescriptor) *msgPlan {
	if p, ok := plans.Load(md); ok {
		return p.(*msgPlan)
	}
	fields := md.Fields()
	p := &msgPlan{fields: make([]fieldPlan, fields.Len()), isAny: isAny(md), digest: schemaDigest(md),
		extensible: md.ExtensionRanges().Len() > 0, mayExtend: mayExtend(md)}
	for i := range p.fields {
		p.fields[i] = makeFieldPlan(fields.Get(i))
	}
	if p.isAny {
		p.anyURL, p.anyValue = fields.ByNumber(1).Index(), fields.ByNumber(2).Index()
	}
	p.row = encodeRow(p.fields)
	actual, _ := plans.LoadOrStore(md, p)
	return actual.(*msgPlan)
}

func extensionPlan(fd protoreflect.FieldDescriptor) *fieldPlan {
	if f, ok := plans.Load(fd); ok {
		return f.(*fieldPlan)
	}
	f := makeFieldPlan(fd)
	actual, _ := plans.LoadOrStore(fd, &f)
	return actual.(*fieldPlan)
}

// encodeRow encodes what a message type knows: its declared fields, as
// runs of consecutive numbers alike.
func encodeRow(fields []fieldPlan) []byte {
	byNumber := make([]*fieldPlan, len(fields))
	for i := range fields {
		byNumber[i] = &fields[i]
	}
	slices.SortFunc(byNumber, func(a, b *fieldPlan) int { return cmp.Compare(a.number, b.number) })
	alike := func(a, b *fieldPlan) bool {
		return a.number+1 == b.number && a.tag == b.tag && a.closed == b.closed && a.enum == b.enum && bytes.Equal(a.def, b.def)
	}
	var runs [][]*fieldPlan
	for i, f := range byNumber {
		if i > 0 && alike(byNumber[i-1], f) {
			runs[len(runs)-1] = append(runs[len(runs)-1], f)
		} else {
			runs = append(runs, []*fieldPlan{f})
		}
	}
	b := binary.AppendUvarint([]byte{rowRuns}, uint64(len(runs)))
	for _, run := range runs {
		f := run[0]
		b = binary.AppendUvarint(b, uint64(f.number))
		b = binary.AppendUvarint(b, uint64(len(run)))
		var flag byte
		if f.def != nil {
			flag |= runDefault
		}
		if f.closed {
			flag |= runEnum
		}
		b = append(b, f.tag, flag)
		b = append(b, f.def...)
		if f.closed {
			b = append(b, f.enum[:]...)
		}
	}
	if len(b) > maxRowLen {
		// Too wide to list: two of one schema still compare every field.
		sum := sha256.Sum256(b)
		return append([]byte{rowDigest}, sum[:digestLen]...)
	}
	return b
}

// isAny reports whether md is google.protobuf.Any: by name and by its
// fields' kinds, since a run-time schema may declare a look-alike.
func isAny(md protoreflect.MessageDescriptor) bool {
	fields := md.Fields()
	url, value := fields.ByNumber(1), fields.ByNumber(2)
	return md.FullName() == "google.protobuf.Any" &&
		url != nil && url.Kind() == protoreflect.StringKind && !url.IsList() &&
		value != nil && value.Kind() == protoreflect.BytesKind && !value.IsList()
}

// mayExtend reports whether md, or a message type its fields reach, has
// extension ranges.
func mayExtend(md protoreflect.MessageDescriptor) bool {
	seen := map[protoreflect.FullName]bool{}
	var reach func(protoreflect.MessageDescriptor) bool
	reach = func(md protoreflect.MessageDescriptor) bool {
		if seen[md.FullName()] {
			return false
		}
		seen[md.FullName()] = true
		if md.ExtensionRanges().Len() > 0 {
			return true
		}
		fields := md.Fields()
		for i := range fields.Len() {
			if sub := fields.Get(i).Message(); sub != nil && reach(sub) {
				return true
			}
		}
		return false
	}
	return reach(md)
}

// schemaDigests caches schemaDigest by descriptor.
var schemaDigests sync.Map // protoreflect.MessageDescriptor -> [8]byte

// schemaDigest summarises what a leaf's hash of a message depends on: for
// it and every message it reaches, each field's number, kind, cardinality,
// whether it is a map or in a real oneof, its default, and the values of a
// closed enum. Names do not count (a map's entry message is named after
// its field): a message met again is referred to by the order in which it
// was first met.
func schemaDigest(md protoreflect.MessageDescriptor) [8]byte {
	if d, ok := schemaDigests.Load(md); ok {
		return d.([8]byte)
	}
	var b strings.Builder
	seen := map[protoreflect.FullName]int{}
	var describe func(protoreflect.MessageDescriptor)
	describe = func(md protoreflect.MessageDescriptor) {
		if i, ok := seen[md.FullName()]; ok {
			fmt.Fprintf(&b, "ref %d;", i)
			return
		}
		seen[md.FullName()] = len(seen)
		fields := md.Fields()
		order := make([]int, fields.Len())
		for i := range order {
			order[i] = i
		}
		slices.SortFunc(order, func(x, y int) int { return int(fields.Get(x).Number() - fields.Get(y).Number()) })
		fmt.Fprintf(&b, "msg %t {", isAny(md))
		for _, i := range order {
			f := makeFieldPlan(fields.Get(i))
			fmt.Fprintf(&b, "%d %v %v %x", f.number, f.fd.Kind(), f.fd.Cardinality(), f.tag)
			if f.closed {
				fmt.Fprintf(&b, " enum %x", f.enum)
			}
			if f.zeroAbsent {
				fmt.Fprintf(&b, " default %x", f.def)
			}
			b.WriteString(";")
			if f.isMsg {
				describe(f.fd.Message())
			}
		}
		b.WriteString("}")
	}
	describe(md)
	sum := sha256.Sum256([]byte(b.String()))
	var d [8]byte
	copy(d[:], sum[:])
	schemaDigests.Store(md, d)
	return d
}

// enumDigest summarises the values of an enum.
func enumDigest(ed protoreflect.EnumDescriptor) (d [8]byte) {
	vals := ed.Values()
	nums := make([]int64, vals.Len())
	for i := range nums {
		nums[i] = int64(vals.Get(i).Number())
	}
	slices.Sort(nums)
	b := []byte("enum")
	for _, n := range nums {
		b = binary.AppendVarint(b, n)
	}
	sum := sha256.Sum256(b)
	copy(d[:], sum[:])
	return d
}
