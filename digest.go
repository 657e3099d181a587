package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"hash"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// requestDigest is what the keys a call derives know of its proto request:
// a SHA-256 of its deterministic encoding in which, at every level of a
// message the schema declares, the fields are in the order of their
// numbers (the elements of one repeated field keep theirs) and a map's
// entries in an order of their own. A field this build declares and the
// same field held as unknown by a build that did not declare it are
// written alike: the encoding writes known fields in number order and
// unknown ones after them, as received; the digest orders both. Values are
// hashed as the schema reads them: a string is bytes, whatever they look
// like, and only a field declared as a message (or the message an Any
// packs, when its type is linked in) is read as one. So the same request
// derives the same keys on every build and from every client, and two
// requests the engine tells apart derive different keys.
//
// What a build reads differently from how the client sent it is not
// ordered away: a proto3 list sent unpacked, an explicit zero of a field
// without presence, a map held as unknown (its entries in the client's
// order), an Any whose type is not linked in. A request sent so, and a
// deploy that declares the field (or links the type in) between a call's
// crash and its re-run, derive other keys.
//
// It is taken before the handler runs: the handler may change its request.
func requestDigest(req proto.Message) (sum [sha256.Size]byte) {
	d := digesters.Get().(*digester)
	defer digesters.Put(d)
	b, err := proto.MarshalOptions{Deterministic: true, AllowPartial: true}.MarshalAppend(d.buf[:0], req)
	d.buf = b[:0]
	if err == nil {
		if sum, ok := d.level(b, req.ProtoReflect().Descriptor(), 0); ok {
			return sum
		}
	}
	// Bytes that do not parse (they always do) or a request that does not
	// marshal (then its fingerprint failed before): the encoding as it is.
	return sha256.Sum256(b)
}

var digesters = sync.Pool{New: func() any { return new(digester) }}

// digester is the scratch space of requestDigest, kept between calls.
type digester struct {
	buf    []byte
	spans  []digestField // the fields of the levels being read
	hashes []hash.Hash   // one per depth
	tag    [binary10]byte
	out    [sha256.Size]byte // what a level's hash writes its sum to
}

const binary10 = 10 // a uvarint's longest encoding

// digestField is one field of a level: its number, and either its bytes
// in the input or the digest of the message it holds.
type digestField struct {
	num      protowire.Number
	from, to int
	message  bool
	mapEntry bool // an entry of a map field, read as a message
	sum      [sha256.Size]byte
}

// What the digest knows of google.protobuf.Any: the message it packs is
// read with its schema when that is linked in, so that the packed
// message's field order, and its map's entries, count as they do
// unpacked.
const (
	anyFullName                    = "google.protobuf.Any"
	anyURLField   protowire.Number = 1
	anyValueField protowire.Number = 2
)

// anyPacked is the schema of the message the Any encoded in b packs, nil
// when its type is not linked in.
func anyPacked(b []byte) protoreflect.MessageDescriptor {
	var url []byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return nil
		}
		if num == anyURLField && typ == protowire.BytesType {
			url, _ = protowire.ConsumeBytes(b[n:])
		}
		b = b[n+m:]
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByURL(string(url))
	if err != nil {
		return nil
	}
	return mt.Descriptor()
}

// Marks of a level's entries: a message's digest, or a field's bytes.
var markMessage, markRaw = []byte{'m'}, []byte{'r'}

// maxDigestDepth bounds the levels read as messages; deeper ones are
// hashed as their bytes.
const maxDigestDepth = 64

// level digests the message md encoded in b.
func (d *digester) level(b []byte, md protoreflect.MessageDescriptor, depth int) (sum [sha256.Size]byte, ok bool) {
	start := len(d.spans)
	defer func() { d.spans = d.spans[:start] }()
	var packed protoreflect.MessageDescriptor // what an Any packs, when linked in
	if md.FullName() == anyFullName {
		packed = anyPacked(b)
	}
	for pos := 0; pos < len(b); {
		num, typ, n := protowire.ConsumeTag(b[pos:])
		if n < 0 {
			return sum, false
		}
		f := digestField{num: num, from: pos}
		var sub protoreflect.MessageDescriptor
		if fd := md.Fields().ByNumber(num); fd != nil && fd.Message() != nil {
			sub, f.mapEntry = fd.Message(), fd.IsMap()
		} else if packed != nil && num == anyValueField {
			sub = packed
		}
		if sub != nil && typ == protowire.BytesType && depth < maxDigestDepth {
			v, m := protowire.ConsumeBytes(b[pos+n:])
			if m < 0 {
				return sum, false
			}
			if f.sum, ok = d.level(v, sub, depth+1); !ok {
				return sum, false
			}
			f.message = true
			n += m
		} else {
			f.mapEntry = false
			m := protowire.ConsumeFieldValue(num, typ, b[pos+n:])
			if m < 0 {
				return sum, false
			}
			n += m
		}
		pos += n
		f.to = pos
		d.spans = append(d.spans, f)
	}
	fields := d.spans[start:]
	slices.SortStableFunc(fields, func(x, y digestField) int {
		if c := cmp.Compare(x.num, y.num); c != 0 || !x.mapEntry || !y.mapEntry {
			return c
		}
		return bytes.Compare(x.sum[:], y.sum[:]) // a map's entries have no order
	})
	for len(d.hashes) <= depth {
		d.hashes = append(d.hashes, sha256.New())
	}
	h := d.hashes[depth]
	h.Reset()
	for i := range fields {
		f := &fields[i]
		if f.message {
			h.Write(protowire.AppendTag(d.tag[:0], f.num, protowire.BytesType))
			h.Write(markMessage)
			h.Write(f.sum[:])
			continue
		}
		h.Write(markRaw)
		h.Write(protowire.AppendVarint(d.tag[:0], uint64(f.to-f.from)))
		h.Write(b[f.from:f.to])
	}
	copy(sum[:], h.Sum(d.out[:0]))
	return sum, true
}
