package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
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
// Version 2 (message bodies of streams, HTTP requests, and proto requests
// before version 3) is flat:
//
//	schema     8 bytes: what the encoding depends on (the kind of request)
//	sum        32 bytes: SHA-256 of the request
//
// Two version 2 fingerprints are compared only when their schema agrees.
//
// Version 3 (proto requests) has a part per field, so that two releases of
// a request's schema can compare the fields both know:
//
//	method     16 bytes: SHA-256 of the full method, truncated
//	node       the request's message
//
//	node       count (uvarint), then count entries in field number order,
//	           one for every field the schema knows (declared, and the
//	           extensions present)
//	entry      number (uvarint), tag (1 byte: kind, list, map, in a real
//	           oneof), form (1 byte), then by form:
//	  absent     nothing: not present, or a singular scalar equal to its
//	             zero value outside a oneof
//	  hash       16 bytes: a scalar or a list of scalars
//	  node       a singular message, to maxNodeDepth levels
//	  leaf       8 bytes of schema digest, 16 bytes of hash: a list or map
//	             of messages, a message below maxNodeDepth, a closed enum
//	  absentLeaf 8 bytes of schema digest: an absent closed enum
//
// Two version 3 fingerprints name the same request when, for every field
// number both nodes list with the same tag, both are absent or both hold
// the same value; a field only one side knows, or one whose kind or form
// differs, is not comparable and is skipped. So a field added or removed
// by a deploy, a proto2 extension linked in by a rebuild, or presence
// added to a scalar never makes a retry KEY_REUSED, while the fields both
// sides know are still compared exactly.
//
// Fingerprints of different versions, and tagged against untagged, are not
// comparable: the call counts as the same request, so an upgrade never
// turns a retry into KEY_REUSED. Untagged fingerprints (those of the first
// release, or a caller's own) are compared byte for byte with each other.
const (
	fingerprintMagic   = "\xffIDF"
	fingerprintVersion = 2 // of tagged: the flat format
	fingerprintLen     = len(fingerprintMagic) + 1 + 8 + sha256.Size

	fieldsVersion   = 3 // the per-field format of proto requests
	fieldsHeadLen   = len(fingerprintMagic) + 1 + hashLen
	hashLen         = 16
	digestLen       = 8
	maxNodeDepth    = 8
	maxFieldsLen    = 16 << 10 // beyond it, the request is one leaf
	maxAnyUnpacking = 16       // Any within Any unpacked, at most
)

// Forms of a version 3 entry.
const (
	formAbsent byte = iota
	formHash
	formNode
	formLeaf
	formAbsentLeaf
)

// Fingerprint identifies a proto request for key-reuse checks: a hash of
// the full method and, for each field the server's schema knows, a hash of
// its value (see [Call.Fingerprint]). The error is always nil; it is kept
// for callers of the first release.
//
// Values are compared as the server decoded them, never as encoded: fields
// the server does not know (sent by a newer client) are left out, map
// entries count in key order, a singular scalar equal to its zero value
// counts as absent (so adding or removing presence changes nothing), -0
// is 0 and every NaN is one value, and an Any whose type is linked into
// the server (protoregistry.GlobalTypes) counts as the message it packs,
// by type name whatever the URL's prefix. An Any whose type is not linked
// in counts as its bytes with each message level's fields sorted (as far
// as the bytes parse as messages), so its map order does not count either.
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	w := &walker{h: sha256.New()}
	w.buf = w.small[:0]
	out := make([]byte, 0, 128)
	out = append(out, fingerprintMagic...)
	out = append(out, fieldsVersion)
	w.buf = append(w.buf, fullMethod...)
	out = w.sum(out)
	m := req.ProtoReflect()
	if fp := w.node(out, m, 1); len(fp) <= maxFieldsLen {
		return fp, nil
	}
	// Too many fields to keep one by one: the whole request is one leaf,
	// comparable with others of its kind only.
	out = binary.AppendUvarint(out, 1)
	out = append(out, 0, 0)
	return w.leaf(out, planOf(m.Descriptor()).digest, func() { w.message(m) }), nil
}

// messageFingerprint identifies a message body of an at-least-once stream.
func messageFingerprint(body []byte) []byte {
	return tagged(kindDigest("message body"), body)
}

// tagged makes a version 2 fingerprint of parts, each length-prefixed so
// that no two lists of parts hash alike.
func tagged(schema [8]byte, parts ...[]byte) []byte {
	h := sha256.New()
	for _, p := range parts {
		h.Write(binary.AppendUvarint(nil, uint64(len(p))))
		h.Write(p)
	}
	out := make([]byte, 0, fingerprintLen)
	out = append(out, fingerprintMagic...)
	out = append(out, fingerprintVersion)
	out = append(out, schema[:]...)
	return h.Sum(out)
}

// sameRequest reports whether a stored fingerprint and a new one name the
// same request, or cannot be compared (see the format above).
func sameRequest(stored, current []byte) bool {
	if bytes.Equal(stored, current) {
		return true
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
	a, rest, ok := readNode(stored[fieldsHeadLen:], 0)
	if !ok || len(rest) > 0 {
		return false
	}
	b, rest, ok := readNode(current[fieldsHeadLen:], 0)
	if !ok || len(rest) > 0 {
		return false
	}
	return sameNode(a, b)
}

// fpEntry is one parsed entry of a version 3 node.
type fpEntry struct {
	num       uint64
	tag, form byte
	digest    []byte // leaf and absentLeaf
	value     []byte // hash, or leaf's hash, or node's encoding
}

// readNode parses a node, checking that its entries are in field order.
func readNode(b []byte, depth int) (entries []fpEntry, rest []byte, ok bool) {
	n, k := binary.Uvarint(b)
	if k <= 0 || n > uint64(len(b)) || depth > maxNodeDepth+maxAnyUnpacking {
		return nil, nil, false
	}
	b = b[k:]
	entries = make([]fpEntry, 0, n)
	for range n {
		var e fpEntry
		if e.num, k = binary.Uvarint(b); k <= 0 || len(b) < k+2 {
			return nil, nil, false
		}
		e.tag, e.form, b = b[k], b[k+1], b[k+2:]
		if len(entries) > 0 && entries[len(entries)-1].num >= e.num {
			return nil, nil, false
		}
		switch e.form {
		case formAbsent:
		case formHash:
			if len(b) < hashLen {
				return nil, nil, false
			}
			e.value, b = b[:hashLen], b[hashLen:]
		case formLeaf, formAbsentLeaf:
			size := digestLen
			if e.form == formLeaf {
				size += hashLen
			}
			if len(b) < size {
				return nil, nil, false
			}
			e.digest, e.value, b = b[:digestLen], b[digestLen:size], b[size:]
		case formNode:
			_, after, ok := readNode(b, depth+1)
			if !ok {
				return nil, nil, false
			}
			e.value, b = b[:len(b)-len(after)], after
		default:
			return nil, nil, false
		}
		entries = append(entries, e)
	}
	return entries, b, true
}

// sameNode reports whether two nodes hold the same values in every field
// both can compare.
func sameNode(a, b []fpEntry) bool {
	for i, j := 0, 0; i < len(a) && j < len(b); {
		x, y := a[i], b[j]
		switch {
		case x.num < y.num:
			i++
			continue
		case x.num > y.num:
			j++
			continue
		}
		i, j = i+1, j+1
		if x.tag != y.tag {
			continue // another kind or cardinality: not comparable
		}
		if !sameEntry(x, y) {
			return false
		}
	}
	return true
}

// sameEntry compares one field of two nodes with the same number and tag;
// true when they are the same or not comparable.
func sameEntry(x, y fpEntry) bool {
	absent := func(e fpEntry) bool { return e.form == formAbsent || e.form == formAbsentLeaf }
	switch {
	case absent(x) && absent(y):
		return true
	case x.form == formAbsentLeaf || y.form == formAbsentLeaf:
		// A closed enum absent on one side: a value its schema does not
		// know is absent there, so only the same schema compares.
		return !bytes.Equal(x.digest, y.digest) || x.form != formLeaf && y.form != formLeaf
	case absent(x) || absent(y):
		return false // present on one side only
	case x.form != y.form:
		return true // encoded another way since: not comparable
	case x.form == formNode:
		a, _, _ := readNode(x.value, 0)
		b, _, _ := readNode(y.value, 0)
		return sameNode(a, b)
	case x.form == formLeaf && !bytes.Equal(x.digest, y.digest):
		return true // the schema below changed: not comparable
	}
	return bytes.Equal(x.value, y.value)
}

// walker computes one fingerprint. Values are appended to buf, which is
// hashed by h when it grows or a hash is taken.
type walker struct {
	h       hash.Hash
	buf     []byte // starts as small
	small   [512]byte
	scratch [sha256.Size]byte
	dyn     []byte // what a leaf's hash depends on beyond its static schema
	anys    int    // Any messages being unpacked
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

// leaf appends a leaf entry's payload: the digest of what write depends on,
// and the hash of what it writes.
func (w *walker) leaf(out []byte, digest [8]byte, write func()) []byte {
	w.dyn = w.dyn[:0]
	write()
	if len(w.dyn) > 0 {
		sum := sha256.Sum256(append(w.dyn, digest[:]...))
		copy(digest[:], sum[:])
	}
	out = append(out, formLeaf)
	out = append(out, digest[:]...)
	return w.sum(out)
}

// node appends m's node to out.
func (w *walker) node(out []byte, m protoreflect.Message, depth int) []byte {
	p := planOf(m.Descriptor())
	if p.isAny {
		return w.anyNode(out, m, depth)
	}
	exts := extensionsOf(m, p)
	out = binary.AppendUvarint(out, uint64(len(p.fields)+len(exts)))
	i, j := 0, 0
	for i < len(p.fields) || j < len(exts) {
		var f *fieldPlan
		if j == len(exts) || i < len(p.fields) && p.fields[i].number < exts[j].number {
			f, i = &p.fields[i], i+1
		} else {
			f, j = &exts[j], j+1
		}
		out = w.entry(out, m, f, depth)
	}
	return out
}

// entry appends the entry of field f of m.
func (w *walker) entry(out []byte, m protoreflect.Message, f *fieldPlan, depth int) []byte {
	out = binary.AppendUvarint(out, uint64(f.number))
	out = append(out, f.tag)
	v, present := f.get(m)
	switch {
	case !present && f.form == formLeaf && f.fd.Kind() == protoreflect.EnumKind:
		out = append(out, formAbsentLeaf)
		return append(out, f.digest[:]...)
	case !present:
		return append(out, formAbsent)
	case f.form == formHash:
		out = append(out, formHash)
		w.value(f.fd, v)
		return w.sum(out)
	case f.form == formNode && depth < maxNodeDepth:
		return w.node(append(out, formNode), v.Message(), depth+1)
	}
	return w.leaf(out, f.digest, func() { w.value(f.fd, v) })
}

// anyNode appends the node of an Any: its type name (field 1), and the
// message it packs as a node (field 2, a message) when the type is linked
// in, else its bytes canonicalised without a schema (field 2, bytes).
func (w *walker) anyNode(out []byte, m protoreflect.Message, depth int) []byte {
	name, value := anyParts(m)
	out = binary.AppendUvarint(out, 2)
	out = append(out, 1, byte(protoreflect.StringKind))
	if name == "" {
		out = append(out, formAbsent)
	} else {
		out = append(out, formHash)
		w.buf = append(w.buf, name...)
		out = w.sum(out)
	}
	out = append(out, 2)
	if packed := w.unpack(name, value); packed != nil {
		defer func() { w.anys-- }()
		out = append(out, byte(protoreflect.MessageKind))
		if depth < maxNodeDepth {
			return w.node(append(out, formNode), packed, depth+1)
		}
		return w.leaf(out, planOf(packed.Descriptor()).digest, func() { w.message(packed) })
	}
	out = append(out, byte(protoreflect.BytesKind))
	if len(value) == 0 {
		return append(out, formAbsent)
	}
	out = append(out, formHash)
	w.wire(value)
	return w.sum(out)
}

// anyParts returns the type name of an Any's URL (what follows its last
// slash: the prefix names no part of the type) and its value.
func anyParts(m protoreflect.Message) (string, []byte) {
	fields := m.Descriptor().Fields()
	url := m.Get(fields.ByNumber(1)).String()
	return url[strings.LastIndexByte(url, '/')+1:], m.Get(fields.ByNumber(2)).Bytes()
}

// unpack returns the message an Any packs, when its type is linked in and
// its bytes decode; nil otherwise. A message it returns counts in w.anys
// until the caller is done with it.
func (w *walker) unpack(name string, value []byte) protoreflect.Message {
	if w.anys >= maxAnyUnpacking || name == "" {
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
	w.anys++
	return m
}

// value writes the value of field fd.
func (w *walker) value(fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	switch {
	case fd.IsMap():
		w.mapValue(fd, v.Map())
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

// mapValue writes a map's entries in key order.
func (w *walker) mapValue(fd protoreflect.FieldDescriptor, mp protoreflect.Map) {
	keys := make([]protoreflect.MapKey, 0, mp.Len())
	mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
		keys = append(keys, k)
		return true
	})
	switch fd.MapKey().Kind() {
	case protoreflect.StringKind:
		slices.SortFunc(keys, func(a, b protoreflect.MapKey) int { return strings.Compare(a.String(), b.String()) })
	case protoreflect.BoolKind:
		slices.SortFunc(keys, func(a, b protoreflect.MapKey) int { return cmp.Compare(b2i(a.Bool()), b2i(b.Bool())) })
	case protoreflect.Uint32Kind, protoreflect.Uint64Kind, protoreflect.Fixed32Kind, protoreflect.Fixed64Kind:
		slices.SortFunc(keys, func(a, b protoreflect.MapKey) int { return cmp.Compare(a.Uint(), b.Uint()) })
	default:
		slices.SortFunc(keys, func(a, b protoreflect.MapKey) int { return cmp.Compare(a.Int(), b.Int()) })
	}
	w.buf = binary.AppendUvarint(w.buf, uint64(len(keys)))
	for _, k := range keys {
		w.single(fd.MapKey(), k.Value())
		w.single(fd.MapValue(), mp.Get(k))
	}
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

// message writes m whole, for a leaf: its present fields in number order,
// each as number, tag and value, then a 0 (no field's number).
func (w *walker) message(m protoreflect.Message) {
	p := planOf(m.Descriptor())
	if p.isAny {
		name, value := anyParts(m)
		w.bytes([]byte(name))
		if packed := w.unpack(name, value); packed != nil {
			w.dyn = append(w.dyn, 'a')
			d := planOf(packed.Descriptor()).digest
			w.dyn = append(w.dyn, d[:]...)
			w.buf = append(w.buf, 'm')
			w.message(packed)
			w.anys--
			return
		}
		w.dyn = append(w.dyn, 'u')
		w.buf = append(w.buf, 'u')
		w.wire(value)
		return
	}
	exts := extensionsOf(m, p)
	for _, f := range exts {
		w.dyn = binary.AppendUvarint(append(w.dyn, 'x'), uint64(f.number))
		w.dyn = append(w.dyn, f.tag)
	}
	i, j := 0, 0
	for i < len(p.fields) || j < len(exts) {
		var f *fieldPlan
		if j == len(exts) || i < len(p.fields) && p.fields[i].number < exts[j].number {
			f, i = &p.fields[i], i+1
		} else {
			f, j = &exts[j], j+1
		}
		if v, ok := f.get(m); ok {
			w.buf = binary.AppendUvarint(w.buf, uint64(f.number))
			w.buf = append(w.buf, f.tag)
			w.value(f.fd, v)
		}
	}
	w.buf = append(w.buf, 0)
	w.spill()
}

// wire writes the bytes of a message whose schema is unknown, with each
// level's fields sorted (see canonicalWire); bytes that do not parse as a
// message are written as they are.
func (w *walker) wire(b []byte) {
	if c, ok := canonicalWire(b, 0); ok {
		w.buf = append(w.buf, 'c')
		w.bytes(c)
		return
	}
	w.buf = append(w.buf, 'r')
	w.bytes(b)
}

// canonicalWire re-encodes the bytes of a message whose schema is unknown
// so that the order of its fields, at every level whose bytes parse as a
// message, does not count: each field is written as its tag and, for a
// length-delimited one, a marker, its length and its content (itself
// canonicalised when it parses), and the fields are sorted. Two encodings
// of one message that differ in field or map order give the same bytes;
// so may two that differ in the order of a repeated field, or in a string
// that happens to parse as a message (a missed reuse, never a false one).
func canonicalWire(b []byte, depth int) ([]byte, bool) {
	if depth > 32 {
		return nil, false
	}
	var fields [][]byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, false
		}
		var f []byte
		if typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(b[n:])
			if m < 0 {
				return nil, false
			}
			f = protowire.AppendTag(nil, num, typ)
			if c, ok := canonicalWire(v, depth+1); ok && len(v) > 0 {
				f = protowire.AppendBytes(append(f, 'c'), c)
			} else {
				f = protowire.AppendBytes(append(f, 'r'), v)
			}
			n += m
		} else {
			m := protowire.ConsumeFieldValue(num, typ, b[n:])
			if m < 0 {
				return nil, false
			}
			n += m
			f = b[:n]
		}
		fields = append(fields, f)
		b = b[n:]
	}
	slices.SortFunc(fields, bytes.Compare)
	return bytes.Join(fields, nil), true
}

// msgPlan is what a fingerprint needs of a message's schema, made once per
// descriptor.
type msgPlan struct {
	fields     []fieldPlan // by number
	isAny      bool
	extendable bool
	digest     [8]byte // of the message as a leaf (schemaDigest)
}

// fieldPlan is what a fingerprint needs of one field.
type fieldPlan struct {
	fd         protoreflect.FieldDescriptor
	number     protoreflect.FieldNumber
	tag        byte
	form       byte    // formHash, formNode or formLeaf when present
	zeroAbsent bool    // a singular scalar outside a real oneof
	digest     [8]byte // of a leaf's value
}

// get returns f's value in m, and whether it counts as present.
func (f *fieldPlan) get(m protoreflect.Message) (protoreflect.Value, bool) {
	if !m.Has(f.fd) {
		return protoreflect.Value{}, false
	}
	v := m.Get(f.fd)
	return v, !f.zeroAbsent || !isZero(f.fd.Kind(), v)
}

func isZero(k protoreflect.Kind, v protoreflect.Value) bool {
	switch k {
	case protoreflect.BoolKind:
		return !v.Bool()
	case protoreflect.EnumKind:
		return v.Enum() == 0
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return v.Int() == 0
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return v.Uint() == 0
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return v.Float() == 0
	case protoreflect.StringKind:
		return v.String() == ""
	case protoreflect.BytesKind:
		return len(v.Bytes()) == 0
	}
	return false
}

func makeFieldPlan(fd protoreflect.FieldDescriptor) fieldPlan {
	f := fieldPlan{fd: fd, number: fd.Number(), tag: byte(fd.Kind()) & 0x1f, form: formHash}
	if fd.IsList() {
		f.tag |= 0x20
	}
	if fd.IsMap() {
		f.tag |= 0x40
	}
	if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() {
		f.tag |= 0x80
	}
	isMsg := fd.Message() != nil
	switch {
	case fd.IsMap():
		f.form, f.digest = formLeaf, schemaDigest(fd.Message())
	case isMsg && fd.IsList():
		f.form, f.digest = formLeaf, schemaDigest(fd.Message())
	case isMsg:
		f.form, f.digest = formNode, schemaDigest(fd.Message())
	case fd.Enum() != nil && fd.Enum().IsClosed():
		// A value the schema does not know is dropped: only the same set
		// of values compares.
		f.form, f.digest = formLeaf, enumDigest(fd.Enum())
	}
	f.zeroAbsent = !fd.IsList() && !isMsg && f.tag&0x80 == 0
	return f
}

// plans caches planOf by descriptor.
var plans sync.Map // protoreflect.MessageDescriptor -> *msgPlan

func planOf(md protoreflect.MessageDescriptor) *msgPlan {
	if p, ok := plans.Load(md); ok {
		return p.(*msgPlan)
	}
	fields := md.Fields()
	p := &msgPlan{
		fields:     make([]fieldPlan, fields.Len()),
		isAny:      isAny(md),
		extendable: md.ExtensionRanges().Len() > 0,
		digest:     schemaDigest(md),
	}
	for i := range p.fields {
		p.fields[i] = makeFieldPlan(fields.Get(i))
	}
	slices.SortFunc(p.fields, func(a, b fieldPlan) int { return cmp.Compare(a.number, b.number) })
	actual, _ := plans.LoadOrStore(md, p)
	return actual.(*msgPlan)
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

// extensionsOf returns the plans of the extensions present in m, by
// number.
func extensionsOf(m protoreflect.Message, p *msgPlan) []fieldPlan {
	if !p.extendable {
		return nil
	}
	var exts []fieldPlan
	m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		if fd.IsExtension() {
			exts = append(exts, makeFieldPlan(fd))
		}
		return true
	})
	slices.SortFunc(exts, func(a, b fieldPlan) int { return cmp.Compare(a.number, b.number) })
	return exts
}

// schemaDigests caches schemaDigest by descriptor.
var schemaDigests sync.Map // protoreflect.MessageDescriptor -> [8]byte

// schemaDigest summarises what a leaf's hash of a message depends on: for
// it and every message it reaches, its name and each field's number, kind,
// cardinality, whether it is a map or in a real oneof, and the values of a
// closed enum. Field names do not count. (Extensions and packed Any types
// are added per value: see walker.dyn.)
func schemaDigest(md protoreflect.MessageDescriptor) [8]byte {
	if d, ok := schemaDigests.Load(md); ok {
		return d.([8]byte)
	}
	var b strings.Builder
	seen := map[protoreflect.FullName]bool{}
	var describe func(protoreflect.MessageDescriptor)
	describe = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			fmt.Fprintf(&b, "ref %s;", md.FullName())
			return
		}
		seen[md.FullName()] = true
		fields := md.Fields()
		order := make([]int, fields.Len())
		for i := range order {
			order[i] = i
		}
		slices.SortFunc(order, func(x, y int) int { return int(fields.Get(x).Number() - fields.Get(y).Number()) })
		fmt.Fprintf(&b, "msg %s {", md.FullName())
		for _, i := range order {
			fd := fields.Get(i)
			od := fd.ContainingOneof()
			fmt.Fprintf(&b, "%d %v %v %t %t", fd.Number(), fd.Kind(), fd.Cardinality(), fd.IsMap(), od != nil && !od.IsSynthetic())
			if ed := fd.Enum(); ed != nil && ed.IsClosed() {
				d := enumDigest(ed)
				fmt.Fprintf(&b, " enum %x", d)
			}
			b.WriteString(";")
			if fd.Message() != nil {
				describe(fd.Message())
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
